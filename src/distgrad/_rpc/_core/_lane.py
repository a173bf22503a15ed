"""A serial lane: one thread that runs tasks in the order they were given, started on first
use and ended by :meth:`SerialLane.stop`.

The agent decodes one-way notifications on its I/O thread (they are quick, and their order
matters: a gradient message before the pass's end). A notification that carries tensors for
a GPU cannot be decoded there: the copy to the device may wait for the GPU (a training loop's
queued work), and an I/O thread that waits silences heartbeats and gets a live worker
suspected. So on an agent with devices such a notification -- and every one after it while
the lane is busy, to keep their order -- is decoded on the lane instead (issue 29, item 3).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["SerialLane"]

_log = logging.getLogger("distgrad.rpc")
_STOP = object()


class SerialLane:
    """Tasks run one at a time, in order, on one thread of their own."""

    def __init__(self, name: str, on_start: Callable[[], None] | None = None) -> None:
        self._name = name
        self._on_start = on_start
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._pending = 0
        self._thread: threading.Thread | None = None
        self._stopped = False

    def busy(self) -> bool:
        """Whether a task is queued or running (a task given now would run after it)."""
        return self._pending > 0

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` after every task given before it. Raises ``RuntimeError`` once
        stopped."""
        with self._lock:
            if self._stopped:
                raise RuntimeError(f"{self._name} is stopped")
            self._pending += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
        self._queue.put((fn, args))

    def stop(self, timeout: float = 5.0) -> None:
        """Run what was given, then end the thread (waiting at most ``timeout``). Idempotent."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            thread = self._thread
        if thread is not None:
            self._queue.put(_STOP)
            if thread is not threading.current_thread():
                thread.join(timeout)

    def _run(self) -> None:
        if self._on_start is not None:
            self._on_start()
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            fn, args = item
            try:
                fn(*args)
            except BaseException:
                _log.exception("unhandled error in %s", self._name)
            finally:
                with self._lock:
                    self._pending -= 1
