"""Sends that need a connection opened, made off the thread that asked for them.

Opening a connection may wait: a connect, then a handshake that a frozen peer's kernel accepts
and nobody answers (up to ``peer_timeout`` for a suspected peer). Two kinds of thread must never
wait so: the **I/O thread** (while it waits, no connection of its process is read: no response,
no heartbeat, no handshake answer -- and a peer whose own I/O thread dials this worker at the
same moment waits for it in turn, a deadlock that only the handshake timeout ends), and a
**user's thread** sending something nobody waits for (a context's cleanup when the user leaves
``with dist_autograd.context()``: its error must reach the program within the failure bound,
not a handshake timeout later).

So such a send, when no connection to its peer is open, is queued here: one thread per peer
being dialed (started on demand, ended when that peer's queue is empty) connects and sends the
queue's messages in order. A peer's messages that come while its queue is not empty queue
behind it, so they keep their order. The threads belong to the agent: :meth:`Dialer.stop` drops
what waits and joins them (a dial in progress is bounded by the transport's timeouts)."""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable

__all__ = ["Dialer"]

_log = logging.getLogger("distgrad.rpc")


class Dialer:
    """Per-peer queues of sends that wait for a connection, each drained by a thread of its
    own. Thread-safe."""

    def __init__(self, *, on_start: Callable[[], None] | None = None) -> None:
        #: run first on each thread (an isolated agent binds it)
        self._on_start = on_start
        self._lock = threading.Lock()
        self._queues: dict[int, deque[Callable[[], None]]] = {}
        self._threads: dict[int, threading.Thread] = {}
        self._stopped = False
        self.dials = 0  # sends handed here (for tests and statistics)

    def __repr__(self) -> str:
        with self._lock:
            waiting = {rank: len(q) for rank, q in self._queues.items()}
        return f"<Dialer waiting={waiting}>"

    def busy(self, rank: int) -> bool:
        """Whether sends to ``rank`` wait here (a later one must queue behind them)."""
        return rank in self._queues

    def submit(self, rank: int, send: Callable[[], None]) -> None:
        """Run ``send()`` soon on ``rank``'s dialing thread, after what waits there already.
        ``send`` may block; it must handle its own errors (an exception is logged)."""
        with self._lock:
            if self._stopped:
                return
            self.dials += 1
            queue = self._queues.get(rank)
            if queue is not None:
                queue.append(send)
                return
            self._queues[rank] = deque([send])
            thread = threading.Thread(
                target=self._drain, args=(rank,), name=f"distgrad-dial-{rank}", daemon=True
            )
            self._threads[rank] = thread
            thread.start()  # (under the lock: stop() never finds a thread not started yet)

    def _drain(self, rank: int) -> None:
        if self._on_start is not None:
            self._on_start()
        while True:
            with self._lock:
                queue = self._queues.get(rank)
                if not queue or self._stopped:
                    self._queues.pop(rank, None)
                    self._threads.pop(rank, None)
                    return
                send = queue[0]
            try:
                send()
            except Exception:
                _log.exception("unhandled error in a send to rank %s", rank)
            with self._lock:
                queue = self._queues.get(rank)
                if queue:
                    queue.popleft()

    def stop(self, timeout: float = 1.0) -> None:
        """Drop what waits and wait (at most ``timeout``) for sends in progress to end."""
        with self._lock:
            self._stopped = True
            for queue in self._queues.values():
                while len(queue) > 1:  # (the one in progress stays until it ends)
                    queue.pop()
            threads = list(self._threads.values())
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join(timeout)
