"""The calls table: every outgoing call waiting for its answer, by id, and the timeout wheel of
those that time out on the I/O thread (``rpc_async``, internal calls).

Caller threads insert calls while the I/O thread completes, fails and expires them, so every
access takes the table's lock: a peer failure takes the calls on its link out under the lock
(:meth:`CallTable.take_on`), and a call inserted meanwhile is either among them or was
inserted after the link closed -- which its sender sees (``Link.closed``) and fails itself.
A call whose request is still being written (``_Call.sending``) is left to its sender: only
the sender knows whether the frame left (a frame that did not is sent again on a new link;
one that did fails with the link, as the sender sees ``Link.closed`` once the write returns).
(Iterating a plain dict here while callers inserted raised ``dictionary changed size during
iteration`` on the I/O thread: the remaining calls were never failed, and their callers hung.)
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterator

from ..._transport._base import Link
from ._calls import _Call

__all__ = ["TICK", "CallTable"]

TICK = 0.02  # resolution of the timeout wheel, seconds


class CallTable:
    """Outgoing calls by id, and their timeout slots. Thread-safe."""

    def __init__(self) -> None:
        self._calls: dict[int, _Call] = {}
        self._wheel: dict[int, set[int]] = {}
        self._lock = threading.Lock()
        #: a fresh call id (thread-safe: ``itertools.count`` is atomic; its own ``__next__``,
        #: so that taking an id costs no Python call)
        self.next_id: Callable[[], int] = itertools.count(1).__next__
        self._ticking = False  # whether the I/O thread runs the wheel

    def __repr__(self) -> str:
        return f"CallTable(waiting={len(self._calls)}, timing_out={len(self._wheel)} slots)"

    def __len__(self) -> int:
        return len(self._calls)

    def __bool__(self) -> bool:
        return bool(self._calls)

    def __contains__(self, cid: object) -> bool:
        return cid in self._calls

    def __iter__(self) -> Iterator[int]:
        """The ids of the calls waiting now (a snapshot)."""
        with self._lock:
            return iter(list(self._calls))

    def add(self, call: _Call, deadline: float = 0.0) -> bool:
        """Put ``call`` in the table; with a ``deadline`` (monotonic seconds; 0: none) in the
        timeout wheel too, at once (as :meth:`arm`). True if the wheel was idle: the caller
        must start it."""
        with self._lock:
            self._calls[call.cid] = call
            return self._slot(call, deadline) if deadline else False

    def sent(self, call: _Call) -> None:
        """The sender is done writing ``call``'s request (from now on a loss of its link fails
        it where the loss is handled); the sender checks ``Link.closed`` after this."""
        with self._lock:
            call.sending = False

    def pop(self, cid: int) -> _Call | None:
        """Take call ``cid`` out (``None`` if it was completed, failed or expired already);
        whoever gets it finishes it."""
        with self._lock:
            call = self._calls.pop(cid, None)
            if call is not None and call.slot:
                self._unslot(call)
            return call

    def take_on(self, link: Link) -> list[_Call]:
        """Take out every call waiting on ``link`` (which broke), except those still being
        written: their senders fail or resend them."""
        with self._lock:
            taken = [
                call for call in self._calls.values() if call.conn is link and not call.sending
            ]
            for call in taken:
                del self._calls[call.cid]
                if call.slot:
                    self._unslot(call)
        return taken

    def take_all(self) -> list[_Call]:
        """Take out every call (the agent stops)."""
        with self._lock:
            taken = list(self._calls.values())
            self._calls.clear()
            self._wheel.clear()
        for call in taken:
            call.slot = 0
        return taken

    # -- the timeout wheel -------------------------------------------------------------------
    def arm(self, call: _Call, deadline: float) -> bool:
        """Put ``call`` (if still waiting) in the slot of ``deadline`` (monotonic seconds).
        True if the wheel was idle: the caller must start it (call :meth:`expire` each tick
        until it says stop)."""
        with self._lock:
            if call.cid not in self._calls:
                return False
            return self._slot(call, deadline)

    def _slot(self, call: _Call, deadline: float) -> bool:  # (with the lock held)
        slot = int(deadline / TICK) + 1
        call.slot = slot
        self._wheel.setdefault(slot, set()).add(call.cid)
        start = not self._ticking
        self._ticking = True
        return start

    def expire(self, now: float, *, stopping: bool = False) -> tuple[list[_Call], bool]:
        """Take out the calls whose slot has passed at ``now``; and whether to tick again
        (others still wait in the wheel, and the agent is not ``stopping``)."""
        now_slot = int(now / TICK)
        expired: list[_Call] = []
        with self._lock:
            for slot in [s for s in self._wheel if s <= now_slot]:
                for cid in self._wheel.pop(slot):
                    call = self._calls.pop(cid, None)
                    if call is not None:
                        call.slot = 0
                        expired.append(call)
            more = bool(self._wheel) and not stopping
            self._ticking = more
        return expired, more

    def _unslot(self, call: _Call) -> None:  # (with the lock held)
        bucket = self._wheel.get(call.slot)
        if bucket is not None:
            bucket.discard(call.cid)
            if not bucket:
                del self._wheel[call.slot]
        call.slot = 0
