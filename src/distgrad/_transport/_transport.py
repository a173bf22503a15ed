"""The transport: listeners, connections to every peer, heartbeats and peer-failure detection.
(Dialing a peer is the ``_dialing`` stage's, accepting connections the ``_accepting``
stage's -- objects the transport makes and owns --, the connection to the worker itself
``_loopback``'s.)

Each worker listens on TCP (for other hosts) and on an abstract Unix-domain socket (for
workers on the same host and network namespace, which is faster). A worker opens its own
connection to each peer it sends requests to, lazily, on the sending thread; responses come
back on the connection their request went out on. Every connection starts with the
authenticated handshake (``_handshake``), under TLS first when TLS is configured and the
connection is TCP.

What the transport believes of each peer -- suspected, unreachable for a moment, dead -- and
when a heartbeat tick may judge a silent peer are ``_suspicion``'s, shared with the in-memory
transport: a peer is *suspected*, not condemned, when a connection to it breaks without its
goodbye or stays silent past ``peer_timeout`` (the agent fails what waited on it, the next send
connects again, with a fresh handshake); it is *dead* only on proof (a refused connect, its
goodbye, or with ``fail_stop`` any loss). A connect that fails without proof (a timeout, a
backlog filled by a flooding local process) fails that call only. Before a connection is judged
silent, its socket is peeked: data waiting there means this process, not the peer, was not
running.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Mapping

from .._errors import (
    PeerFailureError,
    ProtocolError,
    RpcShutdownError,
)
from .._wire._frames import Frame, Kind, encode_frame
from . import _ring
from ._accepting import Accepting
from ._base import (
    FrameHandler,
    PeerAddress,
    TransportConfig,
    TransportStatistics,
)
from ._connection import Connection
from ._dialing import Dialing
from ._io import IoThread
from ._loopback import LoopbackConnection
from ._poller import ReadPoller
from ._poller import available as poller_available
from ._suspicion import HeartbeatJudge, PeerVerdicts

__all__ = [
    "LoopbackConnection",
    "PeerAddress",
    "SocketTransport",
    "TransportConfig",
    "TransportStatistics",
    "host_identity",
]

_log = logging.getLogger("distgrad.transport")


def host_identity() -> str:
    """Identifies this host *and* network namespace (abstract Unix sockets are per netns)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    try:
        netns = str(os.stat("/proc/self/ns/net").st_ino)
    except OSError:
        netns = "?"
    return f"{socket.gethostname()}/{boot}/{netns}"


class SocketTransport:
    """Connections to the peers of one worker over sockets; owned and closed by the RPC agent
    (the real implementation of the contract in ``_base``)."""

    wants_message_info = False

    def __init__(
        self,
        config: TransportConfig,
        io: IoThread,
        handler: FrameHandler,
        peer_label: Callable[[int], str],
    ) -> None:
        self.config = config
        self._io = io
        self._handler = handler
        self._label = peer_label
        self._peers: dict[int, PeerAddress] = {}
        self._out: dict[int, Connection | LoopbackConnection] = {}
        self._conns: set[Connection] = set()
        self._connect_locks: dict[int, threading.Lock] = {}
        self._locks_guard = threading.Lock()
        #: dead, suspected and unreachable peers, and their incarnations
        self._verdicts = PeerVerdicts(peer_label, fail_stop=config.fail_stop)
        self._judge = HeartbeatJudge(config)
        self._listeners: list[socket.socket] = []
        self._heartbeat: asyncio.TimerHandle | None = None
        self._closing = False
        self._protocol_errors = 0
        self._bytes_read_directly = 0
        self._bytes_through_ring = 0
        self.host_id = host_identity()
        #: the one-shot set the loop reads plain connections through, so that a caller can
        #: take a connection's read role without waking the loop (``_poller``)
        self._poller = ReadPoller(io) if poller_available() else None
        # the stages: connections in (accepting) and out (dialing)
        self._accepting = Accepting(
            config,
            io,
            self,
            label=self._peer_label,
            note_incarnation=self.note_incarnation,
            conns=self._conns,
            poller=self._poller,
            deliver=handler.on_frame,
        )
        self._dialing = Dialing(
            config,
            io,
            self,
            label=self._peer_label,
            note_incarnation=self.note_incarnation,
            peers=self._peers,
            conns=self._conns,
            verdicts=self._verdicts,
            host_id=self.host_id,
            poller=self._poller,
            deliver=handler.on_frame,
        )

    def _peer_label(self, rank: int) -> str:
        return self._label(rank)

    # -- setup -----------------------------------------------------------------------------------
    def listen(self, host: str) -> PeerAddress:
        """Open the listeners (TCP on ``host``, and an abstract Unix socket); return the address."""
        tcp = socket.create_server((host, 0), family=_family(host), backlog=512)
        self._listeners.append(tcp)
        port = tcp.getsockname()[1]
        unix_name: str | None = None
        if self.config.use_unix_sockets and hasattr(socket, "AF_UNIX"):
            unix_name = f"\0distgrad-{uuid.uuid4().hex}"
            unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            unix.bind(unix_name)
            unix.listen(512)
            self._listeners.append(unix)
        for listener in self._listeners:
            listener.setblocking(False)
        self._io.run(self._start_listening())
        return PeerAddress(
            host,
            port,
            unix_name,
            self.host_id,
            self.config.max_message_size,
            tls=self.config.server_ssl is not None,
            incarnation=self.config.incarnation,
        )

    async def _start_listening(self) -> None:
        loop = asyncio.get_running_loop()
        if self._poller is not None:
            self._poller.start()
        for listener in self._listeners:
            loop.add_reader(listener.fileno(), self._accepting.on_accept, listener)
        self._heartbeat = loop.call_later(self._judge.scheduled(time.monotonic()), self._beat)

    def set_peers(self, peers: Mapping[int, PeerAddress]) -> None:
        self._peers.clear()  # (in place: the dialing stage reads the same mapping)
        self._peers.update(peers)
        for rank, address in peers.items():
            self._verdicts.know_incarnation(rank, address.incarnation)

    def add_peer(self, rank: int, address: PeerAddress) -> None:
        self._peers[rank] = address
        if address.incarnation and not self.note_incarnation(rank, address.incarnation):
            return  # a replaced incarnation: it stays dead
        self._verdicts.joined(rank)  # a member joining is reachable
        # Its links may predate its name (a joiner's handshake can arrive before the join):
        # errors about them name it from now on.
        label = self._label(rank)
        for conn in [c for c in list(self._conns) if c.peer == rank]:
            conn.peer_label = label

    def remove_peer(self, rank: int, error: Exception) -> None:
        # (its links stay: the member closes them itself, with a goodbye, once it has told
        # every member -- the request that tells this one is answered on one of them)
        self._verdicts.departed(rank, error)

    def note_incarnation(self, rank: int, incarnation: int) -> bool:
        """Record the incarnation a peer of ``rank`` presented; False for one it replaced
        (a connection of it must be dropped). Another one than the one known is a new
        incarnation: the old one is dead (its connections close, naming it), the new one is
        reachable."""
        accepted, restarted = self._verdicts.note_incarnation(rank, incarnation)
        if restarted is not None:
            for conn in [c for c in self._conns if c.peer == rank and not self.is_current(c)]:
                conn.retired = True  # (what it still reads is dropped: see on_frame)
                conn.close(restarted)
        return accepted

    def is_current(self, conn: Connection) -> bool:
        """Whether ``conn`` belongs to the incarnation known now for its peer."""
        return self._verdicts.is_current(conn.peer, conn.incarnation)

    # -- outgoing --------------------------------------------------------------------------------
    def connection(self, rank: int) -> Connection | LoopbackConnection:
        """The connection for sending to ``rank``, opened (blocking) on first use. A rank known
        dead (or gone from the group: its links stay open until it closes them) fails at once."""
        conn = self._out.get(rank)
        if conn is not None and not conn.closed and rank not in self._verdicts.dead:
            return conn  # (is_dead, inline: this is on every call's path)
        return self._connect(rank)

    def open_link(self, rank: int) -> Connection | LoopbackConnection | None:
        """The connection to ``rank`` if one is open now (never dials, never waits)."""
        conn = self._out.get(rank)
        if conn is None or conn.closed or self._verdicts.is_dead(rank):
            return None
        return conn

    def is_dead(self, rank: int) -> bool:
        """True once ``rank`` is known to be dead (every later send to it fails)."""
        return self._verdicts.is_dead(rank)

    def is_suspected(self, rank: int) -> bool:
        """True while ``rank`` is suspected: its last connection was lost without proof."""
        return self._verdicts.is_suspected(rank)

    def check_alive(self, rank: int) -> None:
        """Raise the peer's failure if it is known to be dead, or if a reconnect to it failed a
        moment ago."""
        self._verdicts.check_alive(rank)

    def _connect(self, rank: int) -> Connection | LoopbackConnection:
        with self._locks_guard:
            lock = self._connect_locks.setdefault(rank, threading.Lock())
        with lock:
            if self._closing:
                raise RpcShutdownError("RPC agent is shutting down; no new connections")
            self.check_alive(rank)
            conn = self._out.get(rank)
            if conn is not None and not conn.closed:
                return conn
            if rank == self.config.rank:
                conn = LoopbackConnection(self.deliver, rank, self._label(rank))
            else:
                conn = self._dialing.open(rank)
            self._out[rank] = conn
            return conn

    # -- callbacks from connections ---------------------------------------------------------------
    def on_frame(self, conn: Connection, frame: Frame) -> None:
        # (The connections this transport makes hand their frames straight to the handler,
        # ``Connection.deliver``, and drop those of a replaced incarnation themselves: the
        # transport marks them ``retired`` when it learns of the new one, before closing them.)
        if not conn.retired:
            self._handler.on_frame(conn, frame)

    def deliver(self, conn: LoopbackConnection, frame: Frame) -> None:
        self._handler.on_frame(conn, frame)

    def on_closed(self, conn: Connection, error: Exception | None) -> None:
        if conn in self._conns:
            self._bytes_read_directly += conn.bytes_read_directly
            self._bytes_through_ring += conn.bytes_through_ring
        self._conns.discard(conn)
        if self._out.get(conn.peer) is conn:
            del self._out[conn.peer]
        # A protocol error condemns the connection, not the peer: whoever sent the bad frame
        # (a buggy or impersonating client that knows the secret) is cut off, the real peer's
        # other connections keep working, and the next send reconnects.
        broken_protocol = isinstance(error, ProtocolError)
        if broken_protocol:
            self._protocol_errors += 1
        if self._closing:
            return
        failure = conn.broken_error()
        if not self.is_current(conn):  # the peer restarted: its new incarnation is not judged
            self._handler.on_connection_lost(conn, failure, peer_dead=True)
            return
        peer_dead = self._verdicts.link_lost(
            conn.peer,
            failure,
            protocol_error=broken_protocol,
            goodbye=conn.goodbye_received,
            nobody_listens=False,  # (a socket learns that only by connecting: a refusal)
            superseded=self._out.get(conn.peer) is not None,
        )
        # (what waited on the peer fails either way; only the dead stay unreachable)
        self._handler.on_connection_lost(conn, failure, peer_dead=peer_dead)

    # -- heartbeats ------------------------------------------------------------------------------
    def _beat(self) -> None:
        judge = self._judge
        now = time.monotonic()
        judging = judge.tick(now)  # (a late tick: this process stalled; it judges no one)
        heartbeat = encode_frame(Kind.HEARTBEAT, 0)
        for conn in list(self._conns):
            if conn.closed:
                continue
            error = judge.silent(self._label(conn.peer), conn.last_recv, now) if judging else None
            if error is not None and not conn.readable_now():
                _log.warning("%s", error)
                conn.close(error)
                continue
            try:
                conn.flush_later()  # frames that waited for a write that did not come
                if judge.wants_heartbeat(conn.last_send, now):
                    conn.send(heartbeat)
            except PeerFailureError:
                pass
        if not self._closing:
            delay = judge.scheduled(time.monotonic())
            self._heartbeat = self._io.loop.call_later(delay, self._beat)

    # -- teardown --------------------------------------------------------------------------------
    def close(self, graceful: bool, timeout: float = 5.0) -> None:
        """Close everything; with ``graceful``, flush and say goodbye to every peer first."""
        if self._closing:
            return
        self._closing = True
        self._accepting.closing = True
        try:
            self._io.run(self._stop_listening(), timeout=5.0)
        except Exception:  # loop already gone
            pass
        loopback = self._out.get(self.config.rank)
        if isinstance(loopback, LoopbackConnection):
            loopback.closed = True
        conns = list(self._conns)
        if graceful:
            for conn in conns:
                conn.close_when_flushed()
            deadline = time.monotonic() + timeout
            while any(not c.closed for c in conns) and time.monotonic() < deadline:
                time.sleep(0.005)
        for conn in conns:
            conn.close(None)
        if self._poller is not None:  # after the connections' own closing, on the loop
            try:
                self._io.call_soon(self._poller.close)
            except RuntimeError:  # the loop is gone (the set closes when collected)
                pass

    async def _stop_listening(self) -> None:
        loop = asyncio.get_running_loop()
        if self._heartbeat is not None:
            self._heartbeat.cancel()
        for listener in self._listeners:
            loop.remove_reader(listener.fileno())
            listener.close()
        self._accepting.cancel_handshakes()

    def sever(self, rank: int) -> None:
        """Close every connection with ``rank`` abruptly (fault injection): no goodbye, so
        both sides take the other for dead."""
        label = self._label(rank)
        error = PeerFailureError(f"the connection to {label} was severed", label)
        self._verdicts.prove_dead(
            rank, error, "severed"
        )  # at once: the next send must not reconnect
        for conn in [c for c in list(self._conns) if c.peer == rank]:
            conn.close(error)

    def statistics(self) -> TransportStatistics:
        return TransportStatistics(
            open_connections=sum(1 for c in self._conns if not c.closed),
            connections_accepted=self._accepting.accepted,
            connections_opened=self._dialing.opened,
            handshakes_failed=self._accepting.failed_handshakes,
            protocol_errors=self._protocol_errors,
            dead_peers=self._verdicts.dead_peers(),
            peer_events=self._verdicts.event_counts(),
            bytes_read_directly=self._bytes_read_directly
            + sum(c.bytes_read_directly for c in list(self._conns)),
            bytes_through_ring=self._bytes_through_ring
            + sum(c.bytes_through_ring for c in list(self._conns)),
            ring_bytes_lent=_ring.lent_bytes(),
            stalls=self._judge.stalls,
        )


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET
