"""Reliable one-way control notices: numbered per peer, resent until acknowledged, run once and
in order on the receiver (issue 14 item 3: no lost control messages).

A notice ``func(*args)`` to a peer gets the next sequence number of that peer and stays in the
sender's outbox until the peer acknowledges it. The receiver runs notices in sequence order,
each once (a duplicate is dropped, one that arrives early waits for the ones before it), and
acknowledges cumulatively (the highest number run so far) with a one-way message that goes
out with its next write to the sender or its next heartbeat tick, so the happy path costs no
write and no wake-up of its own. Whatever is not acknowledged after ``resend_after`` seconds
is sent again, in order -- on a new connection if the old one was lost (a suspected peer that
comes back gets what it missed). A peer proved dead (``peer_is_dead``) drops its outbox: what
was for it can never be delivered, and the handlers are idempotent cleanups nobody waits for.

Numbers belong to one incarnation of each side. A notice carries the sender's incarnation and
the one it was meant for; the receiver drops one meant for an earlier incarnation of itself, and
starts counting afresh when a sender's incarnation changes (a relaunched worker numbers from 1
again). A sender that learns its peer was replaced (``incarnation_of``) drops what it queued for
the old one and numbers from 1 for the new one; an acknowledgement names the sender's
incarnation it answers, so one meant for an earlier incarnation is ignored. Nothing of an old
incarnation reaches a new one.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from .._core import (
    RpcAgent,
    bind_thread,
    current_agent,
    describe_request,
    function_name,
    message_type,
    on_io_thread,
)

__all__ = ["Outbox", "outbox_of"]

_log = logging.getLogger("distgrad.rpc")

#: resend what is not acknowledged after this many heartbeat intervals (at least _MIN_RESEND s)
_RESEND_BEATS = 4
_MIN_RESEND = 0.25

_Notice = tuple[Callable[..., Any], tuple[Any, ...]]


class Outbox:
    """One agent's reliable notices: what it sent and was not acknowledged yet, and what it
    ran of each sender's."""

    def __init__(self, agent: RpcAgent) -> None:
        self._agent = weakref.ref(agent)
        self._me = agent.worker_info.id
        interval = getattr(agent.options, "heartbeat_interval", 0.5) or 0.5
        self.resend_after = max(_RESEND_BEATS * interval, _MIN_RESEND)
        self._lock = threading.Lock()
        self._me_incarnation = agent.incarnation
        self._next: dict[int, int] = {}  # per peer: the number of the next notice to it
        self._unacked: dict[int, dict[int, tuple[_Notice, float]]] = {}  # peer: seq: sent at
        self._peer_incarnation: dict[int, int] = {}  # per peer: the incarnation numbered for
        self._ran: dict[int, int] = {}  # per sender: the highest number run in order
        self._sender_incarnation: dict[int, int] = {}  # per sender: the incarnation counted
        self._early: dict[int, dict[int, _Notice]] = {}  # per sender: notices ahead of a gap
        self._timer: threading.Thread | None = None
        self.resent = 0  # notices sent more than once (for tests and statistics)

    # -- sending ---------------------------------------------------------------------------------
    def send(self, dst: int, func: Callable[..., Any], args: tuple[Any, ...]) -> None:
        """Deliver ``func(*args)`` on ``dst`` once, in order with this agent's other notices to
        it, eventually -- unless ``dst`` is proved dead. Never raises for a lost connection."""
        agent = self._agent()
        incarnation = agent.incarnation_of(dst) if agent is not None else 0
        with self._lock:
            self._follow_incarnation(dst, incarnation)
            seq = self._next.get(dst, 1)
            self._next[dst] = seq + 1
            self._unacked.setdefault(dst, {})[seq] = ((func, args), time.monotonic())
        self._transmit(dst, seq, func, args)
        self._ensure_timer()

    def _follow_incarnation(self, dst: int, incarnation: int) -> None:
        """(Under the lock.) ``dst`` is now ``incarnation``: if that replaced the one numbered
        for, drop what was queued for the old one and number from 1 again."""
        known = self._peer_incarnation.get(dst, 0)
        if not incarnation or known == incarnation:
            return  # (0: not known yet, e.g. in a world without incarnations)
        self._peer_incarnation[dst] = incarnation
        if known:
            dropped = self._unacked.pop(dst, {})
            self._next.pop(dst, None)
            if dropped:
                _log.debug("dropped %d notices for %s: it restarted", len(dropped), dst)

    def pending(self) -> int:
        """How many notices wait for an acknowledgement."""
        with self._lock:
            return sum(len(v) for v in self._unacked.values())

    def _transmit(
        self, dst: int, seq: int, func: Callable[..., Any], args: tuple[Any, ...]
    ) -> None:
        agent = self._agent()
        if agent is None:
            return
        target = self._peer_incarnation.get(dst, 0)
        # Never waits for a dial (a worker thread unpickling a request, the I/O thread): with
        # no connection open, the agent's dialing thread sends it. Lost: resent later.
        agent.post(dst, _reliable_notice, (self._me, self._me_incarnation, target, seq, func, args))

    def _ensure_timer(self) -> None:
        with self._lock:
            if self._timer is not None:
                return
            self._timer = threading.Thread(
                target=self._resend_loop, name="distgrad-outbox", daemon=True
            )
            self._timer.start()

    def _resend_loop(self) -> None:
        agent = self._agent()
        if agent is None:
            return
        bind_thread(agent)
        del agent
        while True:
            time.sleep(self.resend_after / 2)
            agent = self._agent()
            if agent is None or agent.state.stopped:
                with self._lock:
                    self._timer = None
                return
            now = time.monotonic()
            due: list[tuple[int, int, _Notice]] = []
            with self._lock:
                for dst in list(self._unacked):
                    self._follow_incarnation(dst, agent.incarnation_of(dst))
                    queued = self._unacked.get(dst)
                    if queued is None:
                        continue
                    if agent.peer_is_dead(dst):
                        _log.debug("dropped %d notices for %s: dead", len(queued), dst)
                        del self._unacked[dst]
                        continue
                    if any(now - sent >= self.resend_after for _n, sent in queued.values()):
                        for seq in sorted(queued):  # all of them, in order
                            notice, _sent = queued[seq]
                            queued[seq] = (notice, now)
                            due.append((dst, seq, notice))
                if not any(self._unacked.values()):
                    self._timer = None
                    return
            del agent
            for dst, seq, (func, args) in due:
                self.resent += 1
                self._transmit(dst, seq, func, args)

    def acknowledged(self, src: int, incarnation: int, upto: int) -> None:
        """``src`` ran every notice of this agent's ``incarnation`` up to number ``upto``."""
        if incarnation != self._me_incarnation:
            return  # meant for an earlier incarnation of this worker
        with self._lock:
            queued = self._unacked.get(src)
            if queued:
                for seq in [s for s in queued if s <= upto]:
                    del queued[seq]

    # -- receiving (I/O thread) ------------------------------------------------------------------
    def received(
        self,
        src: int,
        src_incarnation: int,
        dst_incarnation: int,
        seq: int,
        func: Callable[..., Any],
        args: tuple[Any, ...],
    ) -> None:
        """Run what is now in order; acknowledge (later: with the next write or tick). A notice
        meant for an earlier incarnation of this worker is dropped; a new incarnation of the
        sender is counted from 1."""
        if dst_incarnation and dst_incarnation != self._me_incarnation:
            _log.debug("dropped notice %s of %s: meant for an earlier incarnation", seq, src)
            return
        ready: list[_Notice] = []
        with self._lock:
            if self._sender_incarnation.get(src) != src_incarnation:
                self._sender_incarnation[src] = src_incarnation
                self._ran.pop(src, None)
                self._early.pop(src, None)
            ran = self._ran.get(src, 0)
            if seq > ran:
                early = self._early.setdefault(src, {})
                early[seq] = (func, args)
                while ran + 1 in early:
                    ran += 1
                    ready.append(early.pop(ran))
                self._ran[src] = ran
        for handler, handler_args in ready:
            try:
                handler(*handler_args)
            except Exception:
                _log.exception("unhandled error in the notice handler %s", function_name(handler))
        agent = self._agent()
        if agent is not None:
            try:
                agent.notify(src, _reliable_ack, (self._me, src_incarnation, ran), later=True)
            except Exception as exc:  # the sender resends; the next one is acknowledged
                _log.debug("acknowledgement to %s not sent: %s", src, exc)


_OUTBOXES: weakref.WeakKeyDictionary[RpcAgent, Outbox] = weakref.WeakKeyDictionary()
_OUTBOXES_LOCK = threading.Lock()


def outbox_of(agent: RpcAgent) -> Outbox:
    """The outbox of ``agent`` (made on first use)."""
    with _OUTBOXES_LOCK:
        box = _OUTBOXES.get(agent)
        if box is None:
            box = _OUTBOXES[agent] = Outbox(agent)
        return box


def _inner_type(args: tuple[Any, ...]) -> tuple[str, object]:
    """A reliable notice is described (and matched by fault injection) as the notice it carries."""
    func, inner = args[4], args[5]
    info = describe_request(func, inner, wrapped=False)
    return info.type, func


@message_type(_inner_type)
@on_io_thread
def _reliable_notice(
    src: int,
    src_incarnation: int,
    dst_incarnation: int,
    seq: int,
    func: Callable[..., Any],
    args: tuple[Any, ...],
) -> None:
    """On the receiver: notice number ``seq`` of worker ``src`` (its ``src_incarnation``), meant
    for ``dst_incarnation`` of this worker (0: whichever). I/O thread: the handlers of reliable
    notices are quick and never block."""
    agent = current_agent()
    if agent is not None:
        outbox_of(agent).received(src, src_incarnation, dst_incarnation, seq, func, args)


@message_type("RELIABLE_NOTICE_ACK")
@on_io_thread
def _reliable_ack(src: int, incarnation: int, upto: int) -> None:
    """On the sender: ``src`` ran every notice of this worker's ``incarnation`` up to ``upto``."""
    agent = current_agent()
    if agent is not None:
        outbox_of(agent).acknowledged(src, incarnation, upto)
