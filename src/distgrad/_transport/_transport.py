"""The transport: listeners, connections to every peer, heartbeats and peer-failure detection.
(Dialing a peer is ``_dialing``'s, accepting connections ``_accepting``'s, the connection to
the worker itself ``_loopback``'s.)

Each worker listens on TCP (for other hosts) and on an abstract Unix-domain socket (for
workers on the same host and network namespace, which is faster). A worker opens its own
connection to each peer it sends requests to, lazily, on the sending thread; responses come
back on the connection their request went out on. Every connection starts with the
authenticated handshake (``_handshake``), under TLS first when TLS is configured and the
connection is TCP.

A peer is *suspected*, not condemned, when a connection to it breaks without its goodbye or
stays silent past ``peer_timeout``: the owner is told (so it fails what was waiting on that
connection, and the backward passes waiting on the peer), but the next send to it connects
again, with a fresh handshake, and succeeds if the peer is back (a frozen process, a healed
partition). A peer is *dead* only on proof: a refused connect (nothing listens there), its
goodbye (it shut down), or (``fail_stop``) any loss at all, torch's and distgrad's old
behaviour; every later send to a dead peer fails at once. A connect that fails without proof
(a timeout, a backlog filled by a flooding local process) fails that call only, and calls in
the next moment (``_RETRY_AFTER``) fail at once with the same error rather than each waiting
for a connect to an unreachable host. Before a connection is judged silent, its socket is
peeked: data waiting there means this process, not the peer, was not running; and a heartbeat
tick that comes late (this process stalled: SIGSTOP, a long GC or GIL hold) judges no one.
A connection closed for a protocol error (a malformed or oversized frame) is dropped alone:
the calls waiting on it fail, but the peer is not even suspected.
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

__all__ = [
    "LoopbackConnection",
    "PeerAddress",
    "SocketTransport",
    "TransportConfig",
    "TransportStatistics",
    "host_identity",
]

_log = logging.getLogger("distgrad.transport")
# A heartbeat tick later than this (and than one interval) means this process stalled
_STALL = 0.5


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


class SocketTransport(Accepting, Dialing):
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
        self._dead: dict[int, PeerFailureError] = {}
        #: the incarnation known for each rank, and those it replaced (never accepted again)
        self._incarnations: dict[int, int] = {}
        self._retired: set[tuple[int, int]] = set()
        #: peers whose connection was lost without proof of death (rank -> the error)
        self._suspected: dict[int, PeerFailureError] = {}
        #: a failed reconnect to a suspected peer: (until when calls fail at once, the error)
        self._unreachable: dict[int, tuple[float, PeerFailureError]] = {}
        self._listeners: list[socket.socket] = []
        self._handshakes: set[asyncio.Task[None]] = set()
        # pending handshakes whose peer has sent nothing yet (oldest first), and those of them
        # ended to make room for a connection that had (see _on_accept)
        self._silent: dict[asyncio.Task[None], socket.socket] = {}
        self._shed: set[asyncio.Task[None]] = set()
        self._heartbeat: asyncio.TimerHandle | None = None
        self._beat_due = 0.0  # when the next heartbeat tick should run (time.monotonic())
        self._skipped_judging = False
        self._stalls = 0  # ticks that found this process had not been running
        self._closing = False
        self._accepted = self._opened = self._failed_handshakes = self._protocol_errors = 0
        self._bytes_read_directly = 0
        self.host_id = host_identity()

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
        for listener in self._listeners:
            loop.add_reader(listener.fileno(), self._on_accept, listener)
        self._beat_due = time.monotonic() + self.config.heartbeat_interval
        self._heartbeat = loop.call_later(self.config.heartbeat_interval, self._beat)

    def set_peers(self, peers: Mapping[int, PeerAddress]) -> None:
        self._peers = dict(peers)
        for rank, address in peers.items():
            if address.incarnation:
                self._incarnations.setdefault(rank, address.incarnation)

    def add_peer(self, rank: int, address: PeerAddress) -> None:
        self._peers[rank] = address
        if address.incarnation:
            self.note_incarnation(rank, address.incarnation)

    def remove_peer(self, rank: int, error: Exception) -> None:
        # (its links stay: the member closes them itself, with a goodbye, once it has told
        # every member -- the request that tells this one is answered on one of them)
        label = self._label(rank)
        if not isinstance(error, PeerFailureError):
            error = PeerFailureError(str(error), label)
        self._dead[rank] = error
        self._suspected.pop(rank, None)
        self._unreachable.pop(rank, None)

    def note_incarnation(self, rank: int, incarnation: int) -> bool:
        """Record the incarnation a peer of ``rank`` presented; False for one it replaced
        (a connection of it must be dropped). Another one than the one known is a new
        incarnation: the old one is dead (its connections close, naming it), the new one is
        reachable."""
        if not incarnation:
            return True
        if (rank, incarnation) in self._retired:
            return False
        known = self._incarnations.get(rank)
        self._incarnations[rank] = incarnation
        if known is None or known == incarnation:
            return True
        self._retired.add((rank, known))
        label = self._label(rank)
        failure = PeerFailureError(
            f"{label} restarted: its incarnation {known:016x} was replaced by {incarnation:016x}; "
            "what depended on the old one (calls in flight, RRefs it owned, contexts it took "
            "part in) is lost",
            label,
        )
        self._dead.pop(rank, None)
        self._suspected.pop(rank, None)
        self._unreachable.pop(rank, None)
        for conn in [c for c in self._conns if c.peer == rank and c.incarnation == known]:
            conn.close(failure)
        return True

    def is_current(self, conn: Connection) -> bool:
        """Whether ``conn`` belongs to the incarnation known now for its peer."""
        return not conn.incarnation or self._incarnations.get(conn.peer) in (None, conn.incarnation)

    # -- outgoing --------------------------------------------------------------------------------
    def connection(self, rank: int) -> Connection | LoopbackConnection:
        """The connection for sending to ``rank``, opened (blocking) on first use."""
        conn = self._out.get(rank)
        if conn is not None and not conn.closed:
            return conn
        return self._connect(rank)

    def is_dead(self, rank: int) -> bool:
        """True once ``rank`` is known to be dead (every later send to it fails)."""
        return rank in self._dead

    def is_suspected(self, rank: int) -> bool:
        """True while ``rank`` is suspected: its last connection was lost without proof."""
        return rank in self._suspected

    def check_alive(self, rank: int) -> None:
        """Raise the peer's failure if it is known to be dead, or if a reconnect to it failed a
        moment ago."""
        dead = self._dead.get(rank)
        if dead is not None:
            raise PeerFailureError(str(dead), dead.peer)
        unreachable = self._unreachable.get(rank)
        if unreachable is not None and time.monotonic() < unreachable[0]:
            raise PeerFailureError(str(unreachable[1]), unreachable[1].peer)

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
                conn = self._open(rank)
            self._out[rank] = conn
            return conn

    # -- callbacks from connections ---------------------------------------------------------------
    def on_frame(self, conn: Connection, frame: Frame) -> None:
        incarnation = conn.incarnation
        if incarnation and self._incarnations.get(conn.peer) not in (None, incarnation):
            return  # a frame of a replaced incarnation (its connection is closing): is_current
        self._handler.on_frame(conn, frame)

    def deliver(self, conn: LoopbackConnection, frame: Frame) -> None:
        self._handler.on_frame(conn, frame)

    def on_closed(self, conn: Connection, error: Exception | None) -> None:
        if conn in self._conns:
            self._bytes_read_directly += conn.bytes_read_directly
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
        if not broken_protocol:
            if conn.goodbye_received or self.config.fail_stop:
                self._dead.setdefault(conn.peer, failure)  # it shut down: proof
            elif self._out.get(conn.peer) is None:  # (a newer connection: it answered since)
                self._suspected[conn.peer] = failure
        # (what waited on the peer fails either way; only the dead stay unreachable)
        self._handler.on_connection_lost(conn, failure, peer_dead=not broken_protocol)

    # -- heartbeats ------------------------------------------------------------------------------
    def _beat(self) -> None:
        cfg = self.config
        now = time.monotonic()
        # A tick far behind its time means this process was not running (stopped, a C call
        # holding the GIL, a stalled host): what its peers sent meanwhile still waits, unread,
        # in the sockets (libuv runs due timers before it polls), and their silence is this
        # process's own. Such a tick only sends; the loop reads what waits, and the next tick
        # judges (never two ticks in a row skip, so a dead peer is still found, one interval
        # later at most).
        late = now - self._beat_due
        judge = late < max(cfg.heartbeat_interval, _STALL) or self._skipped_judging
        self._skipped_judging = not judge
        if not judge:
            self._stalls += 1
        heartbeat = encode_frame(Kind.HEARTBEAT, 0)
        for conn in list(self._conns):
            if conn.closed:
                continue
            silent = now - conn.last_recv
            if judge and silent > cfg.peer_timeout and not conn.readable_now():
                error = PeerFailureError(
                    f"{conn.peer_label} sent nothing for {silent:.1f}s "
                    f"(peer timeout {cfg.peer_timeout:g}s); it is suspected: what "
                    "waited on it fails, a later call connects again",
                    conn.peer_label,
                )
                _log.warning("%s", error)
                conn.close(error)
                continue
            try:
                conn.flush_later()  # frames that waited for a write that did not come
                if now - conn.last_send >= cfg.heartbeat_interval * 0.5:
                    conn.send(heartbeat)
            except PeerFailureError:
                pass
        if not self._closing:
            self._beat_due = time.monotonic() + cfg.heartbeat_interval
            self._heartbeat = self._io.loop.call_later(cfg.heartbeat_interval, self._beat)

    # -- teardown --------------------------------------------------------------------------------
    def close(self, graceful: bool, timeout: float = 5.0) -> None:
        """Close everything; with ``graceful``, flush and say goodbye to every peer first."""
        if self._closing:
            return
        self._closing = True
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

    async def _stop_listening(self) -> None:
        loop = asyncio.get_running_loop()
        if self._heartbeat is not None:
            self._heartbeat.cancel()
        for listener in self._listeners:
            loop.remove_reader(listener.fileno())
            listener.close()
        for task in list(self._handshakes):
            task.cancel()

    def sever(self, rank: int) -> None:
        """Close every connection with ``rank`` abruptly (fault injection): no goodbye, so
        both sides take the other for dead."""
        label = self._label(rank)
        error = PeerFailureError(f"the connection to {label} was severed", label)
        self._dead.setdefault(rank, error)  # at once: the next send must not reconnect
        for conn in [c for c in list(self._conns) if c.peer == rank]:
            conn.close(error)

    def statistics(self) -> TransportStatistics:
        return TransportStatistics(
            open_connections=sum(1 for c in self._conns if not c.closed),
            connections_accepted=self._accepted,
            connections_opened=self._opened,
            handshakes_failed=self._failed_handshakes,
            protocol_errors=self._protocol_errors,
            dead_peers=tuple(sorted(self._dead)),
            bytes_read_directly=self._bytes_read_directly
            + sum(c.bytes_read_directly for c in list(self._conns)),
            stalls=self._stalls,
        )


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET
