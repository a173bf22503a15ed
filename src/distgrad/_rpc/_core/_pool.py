"""A small elastic thread pool: threads start on demand up to a maximum and stay."""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["ThreadPool", "blocking", "member_pool", "membership"]

_log = logging.getLogger("distgrad.rpc")


class _Membership(threading.local):
    #: the pool the calling thread belongs to (a thread belongs to one pool at most)
    pool: ThreadPool | None = None  # class default: every other thread reads None


#: per thread: its pool (``membership.pool``), read on every call's path without a call
membership = _Membership()


class ThreadPool:
    """Runs submitted callables on up to ``max_threads`` threads, in submission order.

    A new thread is started only when no thread is idle, so a burst of quick tasks is served
    by one warm thread, while blocking tasks get fresh threads until the maximum -- the
    reference's ``num_worker_threads``. A pool thread that blocks waiting for an RPC says so
    (:meth:`enter_blocking`), and does not count against the maximum meanwhile: nested RPCs can
    not exhaust the pool and deadlock, however many are in flight (the reference deadlocks
    once ``num_worker_threads`` calls wait on nested calls).
    """

    def __init__(
        self, name: str, max_threads: int, *, on_start: Callable[[], None] | None = None
    ) -> None:
        self._name = name
        self._on_start = on_start  # run first on every thread of the pool
        self._max = max_threads
        self._queue: queue.SimpleQueue[tuple[Callable[..., Any], tuple[Any, ...]] | None] = (
            queue.SimpleQueue()
        )
        # Every queued task has a designated taker, decided at submit time under the lock: an
        # idle thread (idle -= 1), a thread started for it, or -- when neither is possible --
        # the backlog, served by the next thread that finishes a task instead of going idle.
        # (Counting idle threads as they wake up instead would race with a burst of submits
        # and leave a task queued behind a long one while the pool still had room.)
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._idle = 0
        self._backlog = 0
        self._blocked = 0
        self._lingering = 0  # threads waiting a moment for work of their own (linger_start)
        #: tasks for the next thread that finishes its current one (submit_after_current)
        self._after: deque[tuple[Callable[..., Any], tuple[Any, ...]]] = deque()
        self._stopped = False

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        if self._stopped:
            raise RuntimeError(f"thread pool {self._name} is stopped")
        with self._lock:
            self._designate()
        self._queue.put((fn, args))

    def submit_after_current(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run a quick task that nothing waits for on the next pool thread to finish its
        current task -- after it, on the same thread, so it neither wakes another thread nor
        competes with that task for the GIL -- or at once (as :meth:`submit`) when no thread
        is running a task. A thread that starts waiting for an RPC hands such tasks on."""
        if self._stopped:
            raise RuntimeError(f"thread pool {self._name} is stopped")
        with self._lock:
            if self._running() > 0:
                self._after.append((fn, args))
                return
            self._designate()
        self._queue.put((fn, args))

    def _running(self) -> int:
        """Threads running (or designated for) a task and not blocked in an RPC (lock held)."""
        return len(self._threads) - self._idle - self._blocked

    def _designate(self) -> None:
        """Decide who takes one task about to be queued (lock held)."""
        if self._idle > 0:
            self._idle -= 1
        elif not self._spawn():
            self._backlog += 1

    def _spawn(self) -> bool:
        """Start a thread if there is room (lock held); it takes one queued task."""
        if self._stopped or len(self._threads) >= self._max + self._blocked:
            return False
        thread = threading.Thread(
            target=self._work, name=f"{self._name}-{len(self._threads)}", daemon=True
        )
        self._threads.append(thread)
        thread.start()
        return True

    @property
    def max_threads(self) -> int:
        return self._max

    def busy(self) -> int:
        """Tasks running now, counting those blocked waiting for an RPC (a snapshot)."""
        with self._lock:
            return len(self._threads) - self._idle - self._lingering

    def is_member(self) -> bool:
        """True on one of this pool's threads."""
        return membership.pool is self

    def enter_blocking(self) -> None:
        """The calling pool thread blocks (waiting for an RPC): its slot is free meanwhile."""
        with self._lock:
            self._blocked += 1
            while self._backlog and self._spawn():
                self._backlog -= 1
            handed: list[tuple[Callable[..., Any], tuple[Any, ...]]] = []
            if self._after and self._running() == 0:  # no thread would finish a task first
                handed = list(self._after)
                self._after.clear()
                for _ in handed:
                    self._designate()
        for task in handed:
            self._queue.put(task)

    def exit_blocking(self) -> None:
        with self._lock:
            self._blocked -= 1

    def waiting(self) -> bool:
        """Whether work waits for a thread (or the pool stopped): a thread that finished its
        task will not be let linger (:meth:`linger_start`). A snapshot, without the lock."""
        return bool(self._backlog or self._after or self._stopped)

    def linger_start(self) -> bool:
        """The calling pool thread, its task done, waits a moment for more work of its own
        (the next request on the connection it served): meanwhile it counts neither as busy
        nor against the maximum (as a blocked thread), so nothing queued waits for it. False
        -- and nothing changed -- if it should not linger: the pool is stopping, or work
        waits for a thread."""
        with self._lock:
            if self._stopped or self._backlog or self._after:
                return False
            self._blocked += 1
            self._lingering += 1
        return True

    def linger_end(self) -> None:
        with self._lock:
            self._blocked -= 1
            self._lingering -= 1

    def _work(self) -> None:
        membership.pool = self
        if self._on_start is not None:
            self._on_start()
        get = self._queue.get
        while True:
            item = get()
            if item is None:
                return
            fn, args = item
            try:
                fn(*args)
            except BaseException:
                _log.exception("unhandled error in %s", self._name)
            finally:
                del item, fn, args
            while True:
                with self._lock:
                    after = self._after.popleft() if self._after else None
                    if after is None:
                        if self._backlog:
                            self._backlog -= 1
                        else:
                            self._idle += 1
                        break
                try:  # a task left for after this one (submit_after_current)
                    after[0](*after[1])
                except BaseException:
                    _log.exception("unhandled error in %s", self._name)
                finally:
                    del after

    def stop(self, timeout: float = 2.0) -> None:
        """Let queued work finish, then end the threads (waits at most ``timeout`` in all)."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            threads = list(self._threads)
        for _ in threads:
            self._queue.put(None)
        current = threading.current_thread()
        deadline = time.monotonic() + timeout
        for thread in threads:
            if thread is not current:
                thread.join(max(0.0, deadline - time.monotonic()))


def member_pool(pools: tuple[ThreadPool, ...]) -> ThreadPool | None:
    """The pool of ``pools`` that the calling thread belongs to, if any."""
    pool = membership.pool
    return pool if pool is not None and pool in pools else None


@contextlib.contextmanager
def blocking(pools: tuple[ThreadPool, ...]) -> Iterator[None]:
    """A block that waits for other workers: on a thread of one of ``pools``, its slot is free
    meanwhile (so nested calls cannot exhaust the pool)."""
    pool = member_pool(pools)
    if pool is None:
        yield
        return
    pool.enter_blocking()
    try:
        yield
    finally:
        pool.exit_blocking()
