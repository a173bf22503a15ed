"""The transport: listeners, connections to every peer, heartbeats and peer-failure detection.

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
import errno
import logging
import os
import pickle
import socket
import ssl
import threading
import time
import uuid
from collections.abc import Callable, Mapping

from .._errors import (
    DistgradError,
    HandshakeError,
    PeerFailureError,
    ProtocolError,
    RpcShutdownError,
)
from .._wire._frames import HEADER, Frame, Kind, encode_frame
from .._wire._pickler import allocate_buffer
from ._base import (
    FrameHandler,
    MessageInfo,
    PeerAddress,
    TransportConfig,
    TransportStatistics,
)
from ._connection import Connection, Piece
from ._handshake import (
    PeerClosedHandshake,
    client_handshake,
    server_accept,
    tls_server_handshake,
    wait_readable,
)
from ._io import IoThread

__all__ = [
    "LoopbackConnection",
    "PeerAddress",
    "SocketTransport",
    "TransportConfig",
    "TransportStatistics",
    "host_identity",
]

_log = logging.getLogger("distgrad.transport")
_MAX_PENDING_HANDSHAKES = 128
_SOCKET_BUFFER = 4 * 1024 * 1024
# The one connect error that proves a peer gone: a refusal (nothing listens at its address;
# after the rendezvous every worker listens until it shuts down). Anything else -- a full
# accept backlog (EAGAIN on a Unix socket, which a flooding local process can cause), a
# timeout, an unreachable network -- fails the call that was connecting, never the peer.
_REFUSED = frozenset({errno.ECONNREFUSED})
# After a connect to a suspected peer failed without proof, calls within this long fail at once
_RETRY_AFTER = 0.5
# A heartbeat tick later than this (and than one interval) means this process stalled
_STALL = 0.5
# Connect errors that say nothing about the peer; retried after these pauses.
_TRANSIENT_CONNECT_ERRORS = frozenset(
    {errno.EAGAIN, errno.EINTR, errno.ETIMEDOUT, errno.ENOBUFS, errno.EADDRNOTAVAIL}
)
_CONNECT_RETRY_DELAYS = (0.05, 0.2, 0.5)
_HANDSHAKE_RETRY_DELAYS = (0.1, 0.25, 0.5, 1.0)
# Connections accepted per wake-up of the I/O loop at most (the listen backlog): enough to
# drain a full backlog, so a flood does not keep it full for the peers behind it.
_ACCEPTS_PER_WAKEUP = 512


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


class LoopbackConnection:
    """A connection to this very worker: frames are handed over with their buffers copied,
    exactly as if they had crossed a socket (RPC to self is a real RPC)."""

    closed = False

    def broken_error(self) -> RpcShutdownError:
        return RpcShutdownError("RPC agent is shut down")

    def close(self, error: Exception | None = None) -> None:
        self.closed = True

    def __init__(self, transport: SocketTransport, rank: int, label: str) -> None:
        self.peer = rank
        self.peer_label = label
        self._transport = transport

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
        self.send(encode_frame(kind, message_id, meta, buffers, flags))

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
        # nothing to save on a loopback: delivered now
        self.send(encode_frame(kind, message_id, meta, buffers, flags))

    def send(self, pieces: list[Piece]) -> None:
        if self.closed:
            raise self.broken_error()
        head = pieces[0]
        kind, flags, nbuf, meta_len, message_id = HEADER.unpack_from(head)
        start = HEADER.size + 8 * nbuf
        meta = bytes(memoryview(head)[start : start + meta_len])
        buffers = []
        for piece in pieces[1:]:
            copy = allocate_buffer(len(piece))
            copy[:] = piece
            buffers.append(copy)
        self._transport.deliver(self, Frame(kind, message_id, meta, buffers, flags))


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
                conn = LoopbackConnection(self, rank, self._label(rank))
            else:
                conn = self._open(rank)
            self._out[rank] = conn
            return conn

    def _dial(self, addr: PeerAddress, local: bool, timeout: float) -> tuple[socket.socket, bool]:
        """Connect, retrying errors that say nothing about the peer being gone; return the
        socket and whether it is the Unix one. A Unix socket whose backlog stays full (a local
        process flooding it, or a peer slow to accept) is given up for TCP, which has its own."""
        try:
            return self._dial_retrying(addr, local, timeout), local
        except OSError as exc:
            if not local or exc.errno not in _TRANSIENT_CONNECT_ERRORS:
                raise
        return self._dial_retrying(addr, False, timeout), False

    def _dial_retrying(self, addr: PeerAddress, local: bool, timeout: float) -> socket.socket:
        for delay in _CONNECT_RETRY_DELAYS:
            try:
                return self._dial_once(addr, local, timeout)
            except OSError as exc:
                if exc.errno not in _TRANSIENT_CONNECT_ERRORS:
                    raise
                time.sleep(delay)  # e.g. a full accept backlog
        return self._dial_once(addr, local, timeout)

    def _dial_once(self, addr: PeerAddress, local: bool, timeout: float) -> socket.socket:
        if local:
            assert addr.unix is not None
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.settimeout(timeout)
                sock.connect(addr.unix)
            except OSError:
                sock.close()
                raise
            return sock
        sock = socket.create_connection((addr.host, addr.port), timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def _open(self, rank: int) -> Connection:
        addr = self._peers.get(rank)
        label = self._label(rank)
        if addr is None:
            raise PeerFailureError(f"no address known for {label}", label)
        cfg = self.config
        local = cfg.use_unix_sockets and addr.unix is not None and addr.host_id == self.host_id
        # a suspected peer may be frozen or cut off: do not wait longer than its silence took
        suspected = rank in self._suspected
        connect_timeout = cfg.connect_timeout
        handshake_timeout = cfg.handshake_timeout
        if suspected:
            connect_timeout = min(connect_timeout, cfg.peer_timeout)
            handshake_timeout = min(handshake_timeout, cfg.peer_timeout)
        # A handshake the peer cut short is retried after these pauses: under load (a flood, many
        # peers connecting at once) a worker closes connections it has no handshake slot for.
        tls_mismatch = (cfg.client_ssl is not None) != addr.tls
        if tls_mismatch and not local:  # it would fail, and say less
            raise HandshakeError(_tls_mismatch(label, cfg.client_ssl is not None))
        for attempt, delay in enumerate((*_HANDSHAKE_RETRY_DELAYS, None), 1):
            sock, tcp = self._dial_peer(rank, addr, local, label, connect_timeout)
            if tcp and tls_mismatch:  # over TCP after all (a flooded Unix socket)
                sock.close()
                raise HandshakeError(_tls_mismatch(label, cfg.client_ssl is not None))
            try:
                _tune(sock)
                if tcp and cfg.client_ssl is not None:
                    sock = cfg.client_ssl.wrap_socket(sock, server_hostname=addr.host)
                sock.settimeout(handshake_timeout)
                incarnation = client_handshake(sock, cfg.secret, cfg.rank, rank, cfg.incarnation)
                sock.setblocking(False)
                break
            except (OSError, HandshakeError) as exc:
                sock.close()
                cut_short = isinstance(exc, (PeerClosedHandshake, ConnectionError, ssl.SSLEOFError))
                if cut_short and delay is not None:
                    time.sleep(delay)
                    continue
                failure = _handshake_failure(label, exc, attempt if cut_short else 0)
                if suspected and isinstance(failure, PeerFailureError):
                    # (a frozen peer: its kernel accepts the connection, the process is silent)
                    self._unreachable[rank] = (time.monotonic() + _RETRY_AFTER, failure)
                raise failure from exc
        if not self.note_incarnation(rank, incarnation):
            sock.close()
            raise PeerFailureError(f"{label} answered as an incarnation that was replaced", label)
        self._suspected.pop(rank, None)  # back: it answered a fresh handshake
        self._unreachable.pop(rank, None)
        conn = Connection(self, self._io, sock, rank, label, cfg.max_message_size)
        conn.incarnation = incarnation
        self._conns.add(conn)
        self._opened += 1
        self._io.call_soon(conn.start)
        return conn

    def _dial_peer(
        self, rank: int, addr: PeerAddress, local: bool, label: str, timeout: float
    ) -> tuple[socket.socket, bool]:
        """A connected socket to ``rank`` and whether it is TCP; a refusal condemns the peer."""
        try:
            sock, local = self._dial(addr, local, timeout)
        except OSError as exc:
            if exc.errno in _REFUSED:  # proof: nothing listens there any more
                error = PeerFailureError(f"could not connect to {label}: {exc}", label)
                self._dead.setdefault(rank, error)
            else:  # says nothing about the peer: this call fails, the next one tries again
                error = PeerFailureError(
                    f"could not connect to {label}: {exc} (not presumed dead: a later call "
                    "connects again)",
                    label,
                )
                if rank in self._suspected:
                    self._unreachable[rank] = (time.monotonic() + _RETRY_AFTER, error)
            raise error from exc
        return sock, not local

    # -- incoming --------------------------------------------------------------------------------
    def _on_accept(self, listener: socket.socket) -> None:
        for _ in range(_ACCEPTS_PER_WAKEUP):
            try:
                sock, _addr = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                _log.warning("accept failed: %s", exc)
                return
            if self._closing:
                sock.close()
                continue
            sock.setblocking(False)
            # Every handshake slot taken: a connection whose first bytes have arrived takes the
            # slot of the oldest one that has said nothing yet (so a flood of silent
            # connections cannot keep peers out); any other is closed at once.
            if len(self._handshakes) >= _MAX_PENDING_HANDSHAKES and not (
                _has_spoken(sock) and self._shed_silent()
            ):
                sock.close()
                continue
            is_tcp = sock.family != getattr(socket, "AF_UNIX", None)
            if is_tcp:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            _tune(sock)
            task = self._io.loop.create_task(self._handshake(sock, is_tcp))
            self._handshakes.add(task)
            self._silent[task] = sock
            task.add_done_callback(self._handshakes.discard)

    def _shed_silent(self) -> bool:
        """End the oldest pending handshake whose peer has sent nothing (its task sees EOF
        and drops it quietly); False if there is none."""
        while self._silent:
            task, sock = next(iter(self._silent.items()))
            del self._silent[task]
            if not _has_spoken(sock):  # (a task not started yet may have bytes waiting)
                self._shed.add(task)
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                return True
        return False

    async def _handshake(self, sock: socket.socket, is_tcp: bool) -> None:
        cfg = self.config
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        try:
            peer = _peer_name(sock)
            started = loop.time()
            try:  # the peer's first bytes: until then, a full table may shed this connection
                await asyncio.wait_for(wait_readable(loop, sock), cfg.handshake_timeout)
            finally:
                self._silent.pop(task, None)
            if task in self._shed:
                self._shed.discard(task)
                sock.close()
                return
            left = max(0.0, cfg.handshake_timeout - (loop.time() - started))
            if cfg.server_ssl is not None and is_tcp:
                sock = cfg.server_ssl.wrap_socket(
                    sock, server_side=True, do_handshake_on_connect=False
                )
                await asyncio.wait_for(tls_server_handshake(loop, sock), left)
                left = cfg.handshake_timeout
            rank, incarnation = await asyncio.wait_for(
                server_accept(
                    loop,
                    sock,
                    cfg.secret,
                    cfg.rank,
                    0 if cfg.dynamic else cfg.world_size,
                    cfg.incarnation,
                ),
                left,
            )
        except (HandshakeError, OSError, asyncio.TimeoutError) as exc:
            self._failed_handshakes += 1
            reason = "timed out" if isinstance(exc, asyncio.TimeoutError) else str(exc)
            _log.warning("rejected a connection from %s: handshake %s", peer, reason)
            sock.close()
            return
        if self._closing or not self.note_incarnation(rank, incarnation):
            sock.close()  # (a replaced incarnation: nothing of it is delivered)
            return
        conn = Connection(self, self._io, sock, rank, self._label(rank), cfg.max_message_size)
        conn.incarnation = incarnation
        self._conns.add(conn)
        self._accepted += 1
        conn.start()

    # -- callbacks from connections ---------------------------------------------------------------
    def on_frame(self, conn: Connection, frame: Frame) -> None:
        if conn.incarnation and not self.is_current(conn):
            return  # a frame of a replaced incarnation (its connection is closing)
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


def _tune(sock: socket.socket) -> None:
    for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, option, _SOCKET_BUFFER)
        except OSError:
            pass


def _tls_mismatch(label: str, tls_here: bool) -> str:
    where, not_where = ("this worker", label) if tls_here else (label, "this worker")
    return (
        f"cannot connect to {label}: TLS is configured on {where} but not on {not_where} "
        "(TensorPipeRpcBackendOptions(server_ssl_context=..., client_ssl_context=...) must be "
        "set on every worker, or on none)"
    )


def _handshake_failure(label: str, exc: BaseException, attempts: int) -> DistgradError:
    """The error of a handshake that failed for good. ``attempts``: how often the peer cut
    it short (0: it failed otherwise)."""
    if attempts:
        return HandshakeError(
            f"handshake with {label} failed: the peer closed the connection during the "
            f"handshake, {attempts} times ({exc}). It is refusing handshakes under load (a "
            "connection flood? many workers connecting at once?) or shutting down: retry the "
            "call. (TLS configured on one side only, or a different cluster secret, would be "
            "reported as such.)"
        )
    if isinstance(exc, HandshakeError):
        return HandshakeError(f"handshake with {label} failed: {exc}")
    if isinstance(exc, ssl.SSLError):
        return HandshakeError(
            f"TLS handshake with {label} failed: {exc} (check the TLS contexts: the CA, the "
            "certificates, and that the server's certificate names the address it listens on)"
        )
    if isinstance(exc, TimeoutError):
        return PeerFailureError(
            f"handshake with {label} timed out: it did not answer within the handshake "
            "timeout (stalled or overloaded?); not presumed dead: a later call connects again",
            label,
        )
    return PeerFailureError(f"handshake with {label} failed: {exc}", label)


def _has_spoken(sock: socket.socket) -> bool:
    """Whether bytes from the peer wait on the (non-blocking) socket."""
    try:
        return bool(sock.recv(1, socket.MSG_PEEK))
    except OSError:  # BlockingIOError: nothing yet
        return False


def _peer_name(sock: socket.socket) -> str:
    try:
        name = sock.getpeername()
    except OSError:
        return "?"
    return "a local process" if isinstance(name, (str, bytes)) else f"{name[0]}:{name[1]}"
