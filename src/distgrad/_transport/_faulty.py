"""Fault injection: a transport that wraps another and fails, delays, drops, duplicates or
reorders chosen messages, severs links and freezes workers.

What to do is a :class:`FaultPlan`: a list of :class:`Fault` rules, each choosing messages by
what they mean -- torch's message type (``PYTHON_CALL``, ``RREF_FORK_REQUEST``,
``BACKWARD_AUTOGRAD_REQ`` ...), the function called, the sending and receiving worker, the n-th
match -- plus torch's ``FAULTY_TENSORPIPE`` options (``messages_to_fail`` with
``num_fail_sends``, ``messages_to_delay``). Rules act where a frame is sent, on the sender:

* ``fail``: the send raises :class:`InjectedFailureError` (torch's ``RPCErr:2:Send attempt failed
  intentionally for ...``); nothing is sent;
* ``drop``: nothing is sent, and nothing says so (the call waits for its timeout, or a peer
  failure);
* ``delay``: sent ``seconds`` later, from the sender's I/O thread (later frames may overtake it);
* ``duplicate``: sent twice;
* ``reorder``: held back until the next frame on the same link has gone out (or ``hold``
  seconds passed), then sent after it;
* ``break``: the link is found dead as the frame is written (a reset socket: EPIPE): the link
  closes and the send raises ``FrameNotSentError``; nothing is sent (the peer is suspected,
  not condemned, so a resend connects again);
* ``lose``: sent, then the link breaks at once (the peer may get the frame and run it; its
  answer is lost).

Controls act on the links: :meth:`FaultPlan.sever` closes the links between two workers
abruptly (each side takes the other for dead); :meth:`FaultPlan.freeze` stops a worker's
transport as a stopped process would look (needs a pausable transport: the in-memory one).
:attr:`FaultPlan.applied` records every fault that fired, so a test can check that its fault
did happen.
"""

from __future__ import annotations

import pickle
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from .._errors import FrameNotSentError, InjectedFailureError, PeerFailureError
from .._wire._frames import Frame
from ._base import (
    FrameHandler,
    Link,
    MessageInfo,
    Pausable,
    PeerAddress,
    Severable,
    Transport,
    TransportConfig,
    TransportFactory,
    TransportStatistics,
)
from ._io import IoThread

__all__ = ["Action", "AppliedFault", "Fault", "FaultPlan", "FaultyLink", "FaultyTransport"]

Action = Literal["fail", "drop", "delay", "duplicate", "reorder", "break", "lose"]
_ACTIONS: frozenset[str] = frozenset(
    ("fail", "drop", "delay", "duplicate", "reorder", "break", "lose")
)


@dataclass(frozen=True, slots=True)
class Fault:
    """One rule: ``action`` for each message that matches every given field.

    ``type`` is torch's message type name (a rule for a call type also matches that call when
    distributed autograd wraps it; ``FORWARD_AUTOGRAD_REQ`` matches only wrapped calls);
    ``function`` the called function's qualified name (``"module.func"`` or just ``"func"``;
    for ``remote()`` the function run on the owner); ``src``/``dst`` the sending and receiving
    ranks. ``nth`` picks only the n-th matching message (1-based), ``times`` the first that
    many (default: every match); ``seconds`` is the delay, ``hold`` how long ``reorder`` waits
    for a next frame at most. ``on_fire`` lets a test act at that moment (kill a worker ...)."""

    action: Action
    type: str | None = None
    function: str | None = None
    src: int | None = None
    dst: int | None = None
    nth: int | None = None
    times: int | None = None
    seconds: float = 0.0
    hold: float = 0.5
    #: called (on the sending thread, so it must not block) each time the rule fires
    on_fire: Callable[[], None] | None = None

    def __post_init__(self) -> None:
        if self.action not in _ACTIONS:
            raise ValueError(f"unknown fault action {self.action!r}; one of {sorted(_ACTIONS)}")
        if self.nth is not None and self.nth < 1:
            raise ValueError("nth counts from 1")
        if self.times is not None and self.times < 0:
            raise ValueError("times must not be negative")
        if self.seconds < 0 or self.hold < 0:
            raise ValueError("delays must not be negative")

    def matches(self, src: int, dst: int, info: MessageInfo) -> bool:
        if self.src is not None and self.src != src:
            return False
        if self.dst is not None and self.dst != dst:
            return False
        if self.type is not None and self.type not in (info.type, info.wrapper):
            return False
        if self.function is not None:
            name = info.function
            if name != self.function and not name.endswith("." + self.function):
                return False
        return True


@dataclass(frozen=True, slots=True)
class AppliedFault:
    """A fault that fired: what was done to which message."""

    action: str
    src: int
    dst: int
    type: str
    function: str


class _Rule:
    __slots__ = ("fault", "fired", "seen")

    def __init__(self, fault: Fault) -> None:
        self.fault = fault
        self.seen = 0  # matching messages so far
        self.fired = 0


class FaultPlan:
    """What to do to which messages, and the controls over links; shared by the faulty
    transports of one world (or owned by one worker's). Thread-safe."""

    def __init__(
        self,
        faults: Iterable[Fault] = (),
        *,
        messages_to_fail: Sequence[str] = (),
        num_fail_sends: int = 0,
        messages_to_delay: Mapping[str, float] | None = None,
    ) -> None:
        self._lock = threading.Lock()
        self._rules = [_Rule(f) for f in faults]
        self._fail_types = frozenset(messages_to_fail)
        self._num_fail_sends = num_fail_sends
        self._fail_counts: dict[bytes, int] = {}
        self._delays = dict(messages_to_delay or {})
        self._transports: dict[int, FaultyTransport] = {}
        self.applied: list[AppliedFault] = []

    def __repr__(self) -> str:
        return f"<FaultPlan {len(self._rules)} rules, {len(self.applied)} applied>"

    # -- rules ---------------------------------------------------------------------------------
    def add(self, *faults: Fault) -> None:
        """Add rules (they apply to messages sent from now on)."""
        with self._lock:
            self._rules.extend(_Rule(f) for f in faults)

    def clear(self) -> None:
        """Remove every rule (controls already applied stay: a severed link stays closed)."""
        with self._lock:
            self._rules.clear()
            self._fail_types = frozenset()
            self._delays.clear()

    def fired(self, action: str | None = None, type: str | None = None) -> list[AppliedFault]:
        """The applied faults, optionally only one action's or one message type's."""
        with self._lock:
            return [
                a
                for a in self.applied
                if (action is None or a.action == action) and (type is None or a.type == type)
            ]

    def decide(self, src: int, dst: int, info: MessageInfo, meta: bytes) -> list[Fault]:
        """The faults for one message about to be sent (each recorded as applied)."""
        chosen: list[Fault] = []
        with self._lock:
            outer = info.wrapper or info.type
            if outer in self._fail_types and info.request:
                # torch: each distinct message fails its first num_fail_sends sends
                count = self._fail_counts.get(meta, 0)
                if count < self._num_fail_sends:
                    self._fail_counts[meta] = count + 1
                    chosen.append(Fault("fail"))
            delay = self._delays.get(outer) if info.request else None
            if delay:
                chosen.append(Fault("delay", seconds=delay))
            for rule in self._rules:
                fault = rule.fault
                if not fault.matches(src, dst, info):
                    continue
                rule.seen += 1
                if fault.nth is not None and rule.seen != fault.nth:
                    continue
                if fault.times is not None and rule.fired >= fault.times:
                    continue
                rule.fired += 1
                chosen.append(fault)
            for final in ("fail", "drop"):  # nothing else happens to such a message
                if any(f.action == final for f in chosen):
                    chosen = [next(f for f in chosen if f.action == final)]
                    break
            for fault in chosen:
                self.applied.append(AppliedFault(fault.action, src, dst, info.type, info.function))
        for fault in chosen:
            if fault.on_fire is not None:
                fault.on_fire()
        return chosen

    # -- controls ------------------------------------------------------------------------------
    def _register(self, rank: int, transport: FaultyTransport) -> None:
        with self._lock:
            self._transports[rank] = transport

    def _transport(self, rank: int) -> FaultyTransport:
        with self._lock:
            found = self._transports.get(rank)
        if found is None:
            raise ValueError(f"no faulty transport of rank {rank} in this plan")
        return found

    def sever(self, a: int, b: int) -> None:
        """Cut the links between workers ``a`` and ``b`` (from whichever side this plan holds):
        both take the other for dead."""
        with self._lock:
            holders = [r for r in (a, b) if r in self._transports]
        if not holders:
            raise ValueError(f"this plan holds neither rank {a} nor rank {b}")
        for rank in holders:
            self._transport(rank).sever(b if rank == a else a)

    def freeze(self, rank: int) -> None:
        """Stop worker ``rank``'s transport (nothing in, nothing out, no heartbeats)."""
        self._transport(rank).freeze()

    def thaw(self, rank: int) -> None:
        """Resume a frozen worker: what waited is delivered and sent."""
        self._transport(rank).thaw()


class FaultyLink:
    """A link that applies its transport's plan to the frames sent on it."""

    def __init__(self, inner: Link, transport: FaultyTransport) -> None:
        self.inner = inner
        self.peer = inner.peer
        self.peer_label = inner.peer_label
        self._transport = transport
        self._lock = threading.Lock()
        self._held: list[Callable[[], None]] = []

    def __repr__(self) -> str:
        return f"<FaultyLink over {self.inner!r}>"

    @property
    def closed(self) -> bool:
        return self.inner.closed

    def broken_error(self) -> PeerFailureError:
        error = self.inner.broken_error()
        return PeerFailureError(str(error), self.peer_label)

    def close(self, error: Exception | None = None) -> None:
        self.inner.close(error)

    def send_frame(
        self,
        kind: int,
        message_id: int,
        meta: bytes,
        buffers: list[pickle.PickleBuffer] | None = None,
        flags: int = 0,
        *,
        info: MessageInfo | None = None,
    ) -> None:
        inner = self.inner

        def send() -> None:
            inner.send_frame(kind, message_id, meta, buffers, flags, info=info)

        self._apply(info, meta, send)

    def send_frame_later(
        self,
        kind: int,
        message_id: int,
        meta: bytes,
        buffers: list[pickle.PickleBuffer] | None = None,
        flags: int = 0,
        *,
        info: MessageInfo | None = None,
    ) -> None:
        inner = self.inner

        def send() -> None:
            inner.send_frame_later(kind, message_id, meta, buffers, flags, info=info)

        self._apply(info, meta, send)

    def _apply(self, info: MessageInfo | None, meta: bytes, send: Callable[[], None]) -> None:
        transport = self._transport
        faults = (
            [] if info is None else transport.plan.decide(transport.rank, self.peer, info, meta)
        )
        actions = {fault.action: fault for fault in faults}
        if "fail" in actions:
            assert info is not None
            raise InjectedFailureError(
                f"RPCErr:2:Send attempt failed intentionally for {info.type}"
            )
        if "drop" in actions:
            return
        if "break" in actions:
            message = f"lost the connection to {self.peer_label} while sending: injected break"
            error = PeerFailureError(message, self.peer_label)
            fail_write = getattr(self.inner, "fail_write", None)
            if fail_write is not None:
                fail_write(error)
            else:
                self.inner.close(error)
            raise FrameNotSentError(message, self.peer_label)
        if "lose" in actions:
            send()
            self.inner.close(
                PeerFailureError(
                    f"lost the connection to {self.peer_label}: injected loss", self.peer_label
                )
            )
            return
        copies = 2 if "duplicate" in actions else 1
        delay = actions.get("delay")
        if delay is not None:
            for _ in range(copies):
                transport.io.loop.call_soon_threadsafe(
                    transport.io.loop.call_later, delay.seconds, _quietly, send
                )
            return
        reorder = actions.get("reorder")
        with self._lock:
            held, self._held = self._held, []
            if reorder is not None:
                self._held.extend([send] * copies)
        if reorder is not None:
            transport.io.loop.call_soon_threadsafe(
                transport.io.loop.call_later, reorder.hold, self._release
            )
        else:
            for _ in range(copies):
                send()
        for late in held:  # what an earlier reorder held back goes after this frame
            _quietly(late)

    def _release(self) -> None:
        """A held frame's wait is over with no next frame: send it now."""
        with self._lock:
            held, self._held = self._held, []
        for late in held:
            _quietly(late)


def _quietly(send: Callable[[], None]) -> None:
    """Send a frame that nobody waits on the sending of (a broken link just loses it)."""
    try:
        send()
    except PeerFailureError:
        pass


class _Handler:
    """Sits between the inner transport and the agent: links arrive wrapped."""

    def __init__(self, transport: FaultyTransport, handler: FrameHandler) -> None:
        self._transport = transport
        self._handler = handler

    def on_frame(self, link: Link, frame: Frame) -> None:
        self._handler.on_frame(self._transport.wrap(link), frame)

    def on_connection_lost(self, link: Link, error: Exception, *, peer_dead: bool) -> None:
        self._handler.on_connection_lost(self._transport.wrap(link), error, peer_dead=peer_dead)


class FaultyTransport:
    """A transport that applies a :class:`FaultPlan` to what it sends through ``inner``."""

    wants_message_info = True

    def __init__(
        self,
        inner: TransportFactory,
        plan: FaultPlan,
        config: TransportConfig,
        io: IoThread,
        handler: FrameHandler,
        peer_label: Callable[[int], str],
    ) -> None:
        self.plan = plan
        self.rank = config.rank
        self.io = io
        self._wrapped: dict[int, FaultyLink] = {}  # by id of the inner link
        self._lock = threading.Lock()
        self.inner: Transport = inner(config, io, _Handler(self, handler), peer_label)
        plan._register(config.rank, self)

    def __repr__(self) -> str:
        return f"<FaultyTransport rank={self.rank} over {self.inner!r}>"

    @staticmethod
    def factory(inner: TransportFactory, plan: FaultPlan) -> TransportFactory:
        """A ``TransportFactory`` of faulty transports over ``inner``'s, sharing ``plan``."""

        def build(
            config: TransportConfig,
            io: IoThread,
            handler: FrameHandler,
            peer_label: Callable[[int], str],
        ) -> FaultyTransport:
            return FaultyTransport(inner, plan, config, io, handler, peer_label)

        return build

    def wrap(self, link: Link) -> FaultyLink:
        with self._lock:
            wrapped = self._wrapped.get(id(link))
            if wrapped is None or wrapped.inner is not link:
                wrapped = self._wrapped[id(link)] = FaultyLink(link, self)
            if link.closed:  # forget it (its id may be reused); the caller still gets it
                del self._wrapped[id(link)]
            return wrapped

    # -- the contract --------------------------------------------------------------------------
    def listen(self, host: str) -> PeerAddress:
        return self.inner.listen(host)

    def set_peers(self, peers: Mapping[int, PeerAddress]) -> None:
        self.inner.set_peers(peers)

    def add_peer(self, rank: int, address: PeerAddress) -> None:
        self.inner.add_peer(rank, address)

    def remove_peer(self, rank: int, error: Exception) -> None:
        self.inner.remove_peer(rank, error)

    def connection(self, rank: int) -> FaultyLink:
        return self.wrap(self.inner.connection(rank))

    def open_link(self, rank: int) -> FaultyLink | None:
        link = self.inner.open_link(rank)
        return None if link is None else self.wrap(link)

    def is_dead(self, rank: int) -> bool:
        return self.inner.is_dead(rank)

    def is_suspected(self, rank: int) -> bool:
        return self.inner.is_suspected(rank)

    def check_alive(self, rank: int) -> None:
        self.inner.check_alive(rank)

    def close(self, graceful: bool) -> None:
        self.inner.close(graceful)

    def statistics(self) -> TransportStatistics:
        return self.inner.statistics()

    # -- controls ------------------------------------------------------------------------------
    def sever(self, rank: int) -> None:
        inner = self.inner
        if not isinstance(inner, Severable):
            raise NotImplementedError(f"{type(inner).__name__} cannot sever links")
        inner.sever(rank)

    def freeze(self) -> None:
        inner = self.inner
        if not isinstance(inner, Pausable):
            raise NotImplementedError(
                f"{type(inner).__name__} cannot be frozen: use the in-memory transport, or stop "
                "a real worker process (SIGSTOP)"
            )
        inner.pause()

    def thaw(self) -> None:
        inner = self.inner
        if not isinstance(inner, Pausable):
            raise NotImplementedError(f"{type(inner).__name__} cannot be frozen")
        inner.resume()
