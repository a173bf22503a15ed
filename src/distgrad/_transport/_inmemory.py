"""The in-memory transport: several agents in one process, joined by a :class:`MemoryNetwork`.

It implements the contract of ``_base`` as the socket transport does, minus the sockets: each
agent keeps its own I/O thread, and a frame sent on a link is encoded exactly as for a socket
(``encode_frame``), copied at send time (as ``sendmsg`` copies into the kernel), handed to the
receiver's I/O thread and parsed there by the same ``FrameParser`` -- so the pickling, the
tensor table, the frame limits and the threads a message crosses are those of a real run.
Frames on one link keep their order; a link to the worker itself is an ordinary link
(``_inmemory_link``).

Failure behaves as with sockets, judged by the same logic (``_suspicion``): closing one end of
a link is seen by the other as an end of stream -- proof of death after a ``GOODBYE``, a
suspicion otherwise -- unless nothing listens at the peer's address any more (what a reconnect
would prove at once: it is dead); a worker whose transport is closed refuses new links (a
refused connection: it is dead); links that stay silent past ``peer_timeout`` are closed by the
heartbeat check (a late tick judges no one), and idle links send heartbeats.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
import uuid
from collections.abc import Callable, Mapping

from .._errors import PeerFailureError, ProtocolError, RpcShutdownError
from .._wire._frames import Kind, encode_frame
from ._base import (
    FrameHandler,
    PeerAddress,
    TransportConfig,
    TransportStatistics,
)
from ._inmemory_link import MemoryLink
from ._io import IoThread
from ._suspicion import HeartbeatJudge, PeerVerdicts

__all__ = ["MemoryLink", "MemoryNetwork", "MemoryTransport"]

_log = logging.getLogger("distgrad.transport")
_HEARTBEAT = b"".join(bytes(p) for p in encode_frame(Kind.HEARTBEAT, 0))
_GOODBYE = b"".join(bytes(p) for p in encode_frame(Kind.GOODBYE, 0))


class MemoryNetwork:
    """Where the in-memory transports of one process find each other (one per test world).

    Use :meth:`factory` as the agents' ``transport``."""

    def __init__(self) -> None:
        self.id = f"memory/{uuid.uuid4().hex}"
        self._lock = threading.Lock()
        self._ports = itertools.count(1)
        self._listening: dict[int, MemoryTransport] = {}

    def __repr__(self) -> str:
        return f"<MemoryNetwork {self.id} listening={sorted(self._listening)}>"

    def factory(
        self,
        config: TransportConfig,
        io: IoThread,
        handler: FrameHandler,
        peer_label: Callable[[int], str],
    ) -> MemoryTransport:
        """A ``TransportFactory``: one agent's transport on this network."""
        return MemoryTransport(self, config, io, handler, peer_label)

    def _register(self, transport: MemoryTransport) -> int:
        with self._lock:
            port = next(self._ports)
            self._listening[port] = transport
            return port

    def _unregister(self, port: int) -> None:
        with self._lock:
            self._listening.pop(port, None)

    def _lookup(self, port: int) -> MemoryTransport | None:
        with self._lock:
            return self._listening.get(port)


class MemoryTransport:
    """One agent's links to the others on a :class:`MemoryNetwork`."""

    wants_message_info = False

    def __init__(
        self,
        network: MemoryNetwork,
        config: TransportConfig,
        io: IoThread,
        handler: FrameHandler,
        peer_label: Callable[[int], str],
    ) -> None:
        self.network = network
        self.config = config
        self.io = io
        self.handler = handler
        self._label = peer_label
        self._port = 0
        self._peers: dict[int, PeerAddress] = {}
        self._out: dict[int, MemoryLink] = {}
        self._links: set[MemoryLink] = set()
        self._lock = threading.Lock()  # the tables; never held while taking another's
        self._connect_locks: dict[int, threading.Lock] = {}
        #: dead and suspected peers, and their incarnations
        self._verdicts = PeerVerdicts(peer_label, fail_stop=config.fail_stop)
        self._judge = HeartbeatJudge(config)
        self._heartbeat: asyncio.TimerHandle | None = None
        self._closing = False
        self._accepted = self._opened = self._protocol_errors = 0
        self.paused = False
        self._running = threading.Event()  # cleared while paused (a dial to it waits on it)
        self._running.set()
        # (incoming, function, arguments) of what waits for resume()
        self._held: list[tuple[bool, Callable[..., None], tuple[object, ...]]] = []

    def __repr__(self) -> str:
        return (
            f"<MemoryTransport rank={self.config.rank} port={self._port} "
            f"links={len(self._links)} dead={list(self._verdicts.dead_peers())}>"
        )

    # -- setup -------------------------------------------------------------------------------------
    def listen(self, host: str) -> PeerAddress:
        self._port = self.network._register(self)
        self.io.call_soon(self._start_heartbeats)
        return PeerAddress(
            "memory",
            self._port,
            None,
            self.network.id,
            self.config.max_message_size,
            incarnation=self.config.incarnation,
        )

    def _start_heartbeats(self) -> None:
        if not self._closing:
            delay = self._judge.scheduled(time.monotonic())
            self._heartbeat = self.io.loop.call_later(delay, self._beat)

    def set_peers(self, peers: Mapping[int, PeerAddress]) -> None:
        self._peers = dict(peers)
        for rank, address in peers.items():
            self._verdicts.know_incarnation(rank, address.incarnation)

    def add_peer(self, rank: int, address: PeerAddress) -> None:
        with self._lock:
            self._peers[rank] = address
        if address.incarnation and not self.note_incarnation(rank, address.incarnation):
            return  # a replaced incarnation: it stays dead
        self._verdicts.joined(rank)  # a member joining is reachable (as SocketTransport.add_peer)
        label = self._label(rank)  # (and its earlier links name it from now on)
        with self._lock:
            links = [k for k in self._links if k.peer == rank]
        for link in links:
            link.peer_label = label

    def remove_peer(self, rank: int, error: Exception) -> None:
        # (its links stay: the member closes them itself once it has told every member)
        self._verdicts.departed(rank, error)

    def note_incarnation(self, rank: int, incarnation: int) -> bool:
        """As ``SocketTransport.note_incarnation``: False for a replaced incarnation."""
        accepted, restarted = self._verdicts.note_incarnation(rank, incarnation)
        if restarted is not None:
            with self._lock:
                stale = [k for k in self._links if k.peer == rank and not self.is_current(k)]
            for link in stale:
                link.close(restarted)
        return accepted

    def is_current(self, link: MemoryLink) -> bool:
        """Whether ``link`` belongs to the incarnation known now for its peer."""
        return self._verdicts.is_current(link.peer, link.incarnation)

    # -- outgoing ----------------------------------------------------------------------------------
    def connection(self, rank: int) -> MemoryLink:
        link = self._out.get(rank)
        if link is not None and not link.closed and not self._verdicts.is_dead(rank):
            return link
        with self._lock:
            connecting = self._connect_locks.setdefault(rank, threading.Lock())
        with connecting:  # never while holding self._lock: _open takes the peer's lock
            if self._closing:
                raise RpcShutdownError("RPC agent is shutting down; no new connections")
            self.check_alive(rank)
            link = self._out.get(rank)
            if link is not None and not link.closed:
                return link
            link = self._open(rank)
            with self._lock:
                self._out[rank] = link
                self._links.add(link)
                self._opened += 1
            return link

    def open_link(self, rank: int) -> MemoryLink | None:
        link = self._out.get(rank)
        if link is None or link.closed or self._verdicts.is_dead(rank):
            return None
        return link

    def _open(self, rank: int) -> MemoryLink:
        label = self._label(rank)
        address = self._peers.get(rank)
        if address is None:
            raise PeerFailureError(f"no address known for {label}", label)
        peer = self.network._lookup(address.port) if address.host_id == self.network.id else None
        mine = MemoryLink(self, rank, label)
        theirs = self._handshake(peer, mine, label) if peer is not None else None
        if theirs is None:  # nobody listens there any more: a refused connection
            error = PeerFailureError(f"could not connect to {label}: connection refused", label)
            self._verdicts.prove_dead(rank, error, "refused")
            raise error
        assert peer is not None
        mine.incarnation = peer.config.incarnation
        if not self.note_incarnation(rank, mine.incarnation):
            theirs.close(None)
            raise PeerFailureError(f"{label} answered as an incarnation that was replaced", label)
        mine.other = theirs
        self._verdicts.answered(rank)  # back: it accepted a fresh link
        return mine

    def _handshake(self, peer: MemoryTransport, mine: MemoryLink, label: str) -> MemoryLink | None:
        """The peer's end of a new link, as a socket handshake gets it: answered by the peer's
        I/O thread (a peer whose I/O thread is busy -- blocked in a dial of its own -- leaves
        the dialer waiting), and not at all while the peer is frozen (its kernel would accept
        the connection, its process not answer). Bounded as over sockets: the handshake
        timeout, no more than ``peer_timeout``. None: refused (the peer is gone)."""
        deadline = time.monotonic() + min(self.config.handshake_timeout, self.config.peer_timeout)
        timed_out = PeerFailureError(
            f"handshake with {label} timed out: it did not answer within the handshake "
            "timeout (stalled or overloaded?); not presumed dead: a later call connects again",
            label,
        )
        if peer.paused and not peer._running.wait(max(0.0, deadline - time.monotonic())):
            self._verdicts.reconnect_failed(mine.peer, timed_out)  # (as sockets: see _dialing)
            raise timed_out
        me, incarnation = self.config.rank, self.config.incarnation
        if peer.io.in_loop():  # (a link to itself, opened on its own I/O thread)
            return peer._accept(mine, me, incarnation)
        answered = threading.Event()
        state: list[object] = []  # the peer's end, or "abandoned" (the dialer gave up)
        lock = threading.Lock()

        def accept() -> None:
            with lock:
                if not state:
                    state.append(peer._accept(mine, me, incarnation))
            answered.set()

        try:
            peer.io.call_soon(accept)
        except RuntimeError:  # its loop is closed: it is gone
            return None
        answered.wait(max(0.0, deadline - time.monotonic()))
        with lock:
            if not state:
                state.append("abandoned")
                self._verdicts.reconnect_failed(mine.peer, timed_out)
                raise timed_out
        theirs = state[0]
        assert theirs is None or isinstance(theirs, MemoryLink)
        return theirs

    def _accept(self, dialing: MemoryLink, rank: int, incarnation: int) -> MemoryLink | None:
        """The far end of a link another transport opens to this one (None if closing, or
        if the dialer is an incarnation that was replaced)."""
        if not self.note_incarnation(rank, incarnation):
            return None
        with self._lock:
            if self._closing:
                return None
            link = MemoryLink(self, rank, self._label(rank))
            link.incarnation = incarnation
            link.other = dialing
            self._links.add(link)
            self._accepted += 1
            return link

    def is_dead(self, rank: int) -> bool:
        return self._verdicts.is_dead(rank)

    def is_suspected(self, rank: int) -> bool:
        """True while ``rank`` is suspected: its last link was lost without proof."""
        return self._verdicts.is_suspected(rank)

    def check_alive(self, rank: int) -> None:
        self._verdicts.check_alive(rank)

    # -- events (I/O thread) -----------------------------------------------------------------------
    def _on_closed(self, link: MemoryLink, error: Exception | None) -> None:
        with self._lock:
            self._links.discard(link)
            if self._out.get(link.peer) is link:
                del self._out[link.peer]
        broken_protocol = isinstance(error, ProtocolError)
        if broken_protocol:
            self._protocol_errors += 1
        if self._closing:
            return
        failure = link.broken_error()
        if not self.is_current(link):  # the peer restarted: its new incarnation is not judged
            self.handler.on_connection_lost(link, failure, peer_dead=True)
            return
        peer_dead = self._verdicts.link_lost(
            link.peer,
            failure,
            protocol_error=broken_protocol,
            goodbye=link.goodbye_received,
            # what a reconnect would prove at once (a reset link -- a failed write -- proves
            # nothing of its own)
            nobody_listens=not link.write_failed and not self._listening(link.peer),
            superseded=self._out.get(link.peer) is not None,
        )
        self.handler.on_connection_lost(link, failure, peer_dead=peer_dead)

    def _listening(self, rank: int) -> bool:
        """Whether the agent at ``rank``'s address still listens (a connect would not be
        refused)."""
        address = self._peers.get(rank)
        if address is None or address.host_id != self.network.id:
            return False
        return self.network._lookup(address.port) is not None

    def _beat(self) -> None:
        judge = self._judge
        now = time.monotonic()
        if self.paused:  # a frozen worker neither beats nor checks on its peers
            self._heartbeat = self.io.loop.call_later(judge.scheduled(now), self._beat)
            return
        judging = judge.tick(now)  # (a late tick: this process stalled; it judges no one)
        for link in list(self._links):
            if link.closed:
                continue
            error = judge.silent(self._label(link.peer), link.last_recv, now) if judging else None
            if error is not None:
                link.close(error)
                continue
            try:
                link.flush_later()
                if judge.wants_heartbeat(link.last_send, now):
                    link.send_bytes(_HEARTBEAT)
            except PeerFailureError:
                pass
        if not self._closing:
            delay = judge.scheduled(time.monotonic())
            self._heartbeat = self.io.loop.call_later(delay, self._beat)

    # -- fault injection -------------------------------------------------------------------------
    def sever(self, rank: int) -> None:
        """Close every link with ``rank`` abruptly: each side takes the other for dead."""
        label = self._label(rank)
        error = PeerFailureError(f"the connection to {label} was severed", label)
        with self._lock:
            links = [link for link in self._links if link.peer == rank]
            self._verdicts.prove_dead(
                rank, error, "severed"
            )  # at once: the next send must not reconnect
        for link in links:
            link.close(error)

    def pause(self) -> None:
        """Freeze this worker's links: what arrives waits, what it sends waits, no heartbeats
        go out (so peers presume it dead after their ``peer_timeout``) -- until :meth:`resume`."""
        with self._lock:
            self.paused = True
            self._running.clear()

    def resume(self) -> None:
        """Deliver what waited, in order, then send what waited."""
        with self._lock:
            self.paused = False
            self._running.set()
            held, self._held = self._held, []
            links = list(self._links)
        now = time.monotonic()
        for link in links:  # its silence was ours: do not take the peers for dead now
            link.last_recv = now

        def replay() -> None:
            for incoming, fn, args in held:
                if incoming:
                    fn(*args)

        self.io.call_soon(replay)
        for incoming, fn, args in held:
            if not incoming:
                try:
                    fn(*args)
                except PeerFailureError:
                    pass

    def hold(self, incoming: bool, fn: Callable[..., None], *args: object) -> bool:
        """Keep a delivery (``incoming``) or a send for :meth:`resume`; False if not paused."""
        with self._lock:
            if not self.paused:
                return False
            self._held.append((incoming, fn, args))
            return True

    # -- teardown ----------------------------------------------------------------------------------
    def close(self, graceful: bool) -> None:
        with self._lock:
            if self._closing:
                return
            self._closing = True
            links = list(self._links)
        self.network._unregister(self._port)
        heartbeat = self._heartbeat
        if heartbeat is not None:
            try:
                self.io.call_soon(heartbeat.cancel)
            except RuntimeError:
                pass
        for link in links:
            if graceful:
                try:
                    link.flush_later()  # before the goodbye, after which the peer takes no work
                    link.send_bytes(_GOODBYE)
                except PeerFailureError:
                    pass
            link.close(None)

    def statistics(self) -> TransportStatistics:
        with self._lock:
            open_links = sum(1 for link in self._links if not link.closed)
        return TransportStatistics(
            open_connections=open_links,
            connections_accepted=self._accepted,
            connections_opened=self._opened,
            handshakes_failed=0,
            protocol_errors=self._protocol_errors,
            dead_peers=self._verdicts.dead_peers(),
            peer_events=self._verdicts.event_counts(),
            stalls=self._judge.stalls,
        )
