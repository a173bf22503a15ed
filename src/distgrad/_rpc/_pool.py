"""A small elastic thread pool: threads start on demand up to a maximum and stay."""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["ThreadPool"]

_log = logging.getLogger("distgrad.rpc")


class ThreadPool:
    """Runs submitted callables on up to ``max_threads`` threads, in submission order.

    A new thread is started only when no thread is idle, so a burst of quick tasks is served
    by one warm thread, while blocking tasks get fresh threads until the maximum -- the
    reference's ``num_worker_threads``. A pool thread that blocks waiting for an RPC says so
    (:meth:`blocking`), and does not count against the maximum meanwhile: nested RPCs can
    not exhaust the pool and deadlock, however many are in flight (the reference deadlocks
    once ``num_worker_threads`` calls wait on nested calls).
    """

    def __init__(self, name: str, max_threads: int) -> None:
        self._name = name
        self._max = max_threads
        self._queue: queue.SimpleQueue[tuple[Callable[..., Any], tuple[Any, ...]] | None] = (
            queue.SimpleQueue()
        )
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._idle = 0
        self._blocked = 0
        self._stopped = False
        self._mine = threading.local()

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        if self._stopped:
            raise RuntimeError(f"thread pool {self._name} is stopped")
        self._queue.put((fn, args))
        if self._idle == 0 and len(self._threads) < self._max + self._blocked:
            self._grow()

    def _grow(self) -> None:
        with self._lock:
            room = len(self._threads) < self._max + self._blocked
            if self._idle == 0 and room and not self._stopped:
                thread = threading.Thread(
                    target=self._work, name=f"{self._name}-{len(self._threads)}", daemon=True
                )
                self._threads.append(thread)
                self._idle += 1
                thread.start()

    @contextlib.contextmanager
    def blocking(self) -> Iterator[None]:
        """Mark the calling thread, if it is one of this pool's, as blocked for the block."""
        if not getattr(self._mine, "member", False):
            yield
            return
        with self._lock:
            self._blocked += 1
        if not self._queue.empty():
            self._grow()
        try:
            yield
        finally:
            with self._lock:
                self._blocked -= 1

    def _work(self) -> None:
        self._mine.member = True
        get = self._queue.get
        while True:
            item = get()
            with self._lock:
                self._idle -= 1
            if item is None:
                return
            fn, args = item
            try:
                fn(*args)
            except BaseException:
                _log.exception("unhandled error in %s", self._name)
            finally:
                del item, fn, args
            with self._lock:
                self._idle += 1

    def stop(self, timeout: float = 2.0) -> None:
        """Let queued work finish, then end the threads (waits at most ``timeout``)."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            threads = list(self._threads)
        for _ in threads:
            self._queue.put(None)
        current = threading.current_thread()
        for thread in threads:
            if thread is not current:
                thread.join(timeout)
