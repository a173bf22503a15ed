"""The I/O thread: one asyncio event loop per process (uvloop when installed)."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from .._config import ENV_UVLOOP, env_flag

__all__ = ["IoThread"]

_log = logging.getLogger("distgrad.transport")
T = TypeVar("T")


def _new_loop() -> asyncio.AbstractEventLoop:
    if env_flag(ENV_UVLOOP, True):
        try:
            import uvloop

            loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
            return loop
        except ImportError:
            pass
    return asyncio.new_event_loop()


class IoThread:
    """Owns the event loop and the thread that runs it; stopped by :meth:`stop`."""

    def __init__(
        self, name: str = "distgrad-io", *, on_start: Callable[[], None] | None = None
    ) -> None:
        self.loop = _new_loop()
        self._on_start = on_start
        self._ident: int | None = None
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    @property
    def uses_uvloop(self) -> bool:
        return type(self.loop).__module__.startswith("uvloop")

    def start(self) -> None:
        self._thread.start()
        self._started.wait()

    def _run(self) -> None:
        self._ident = threading.get_ident()
        if self._on_start is not None:
            self._on_start()
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(self._started.set)
        try:
            self.loop.run_forever()
        finally:
            self._ident = None

    def in_loop(self) -> bool:
        """True when called on the I/O thread itself."""
        return threading.get_ident() == self._ident

    def call_soon(self, callback: Callable[..., Any], *args: Any) -> None:
        """Run ``callback(*args)`` on the loop, from any thread."""
        if self.in_loop():
            self.loop.call_soon(callback, *args)
        else:
            self.loop.call_soon_threadsafe(callback, *args)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run a coroutine on the loop and wait for its result (not from the loop itself)."""
        if self.in_loop():
            raise RuntimeError("IoThread.run() called from the I/O thread; it would deadlock")
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the loop, join the thread, close the loop. Idempotent."""
        if not self._thread.is_alive():
            return
        if self.in_loop():
            raise RuntimeError("IoThread.stop() called from the I/O thread")
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout)
        if self._thread.is_alive():
            _log.warning("distgrad I/O thread did not stop within %.1fs", timeout)
            return
        self.loop.close()
