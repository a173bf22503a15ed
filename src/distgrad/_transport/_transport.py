"""The transport: listeners, connections to every peer, heartbeats and peer-failure detection.

Each worker listens on TCP (for other hosts) and on an abstract Unix-domain socket (for
workers on the same host and network namespace, which is faster). A worker opens its own
connection to each peer it sends requests to, lazily, on the sending thread; responses come
back on the connection their request went out on. Every connection starts with the
authenticated handshake (``_handshake``), under TLS first when TLS is configured and the
connection is TCP.

A connection that breaks without the peer's goodbye marks the peer dead: the owner is told
(so it fails what was waiting on that connection) and every later send to that peer fails at
once. Heartbeats bound how long a silent death (a host gone, a network cut) goes unnoticed. A
connection closed for a protocol error (a malformed or oversized frame) is dropped alone: the
calls waiting on it fail, but the peer is not condemned.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import pickle
import socket
import threading
import time
import uuid
from collections.abc import Callable, Mapping

from .._errors import HandshakeError, PeerFailureError, ProtocolError, RpcShutdownError
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
from ._handshake import client_handshake, server_handshake, tls_server_handshake
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
# Connect errors that say nothing about the peer being gone (a refused or unreachable peer is
# gone: after rendezvous every worker listens); retried after these pauses, then fatal.
_TRANSIENT_CONNECT_ERRORS = frozenset(
    {errno.EAGAIN, errno.EINTR, errno.ETIMEDOUT, errno.ENOBUFS, errno.EADDRNOTAVAIL}
)
_CONNECT_RETRY_DELAYS = (0.05, 0.2, 0.5)


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
        self._listeners: list[socket.socket] = []
        self._handshakes: set[asyncio.Task[None]] = set()
        self._heartbeat: asyncio.TimerHandle | None = None
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
        return PeerAddress(host, port, unix_name, self.host_id, self.config.max_message_size)

    async def _start_listening(self) -> None:
        loop = asyncio.get_running_loop()
        for listener in self._listeners:
            loop.add_reader(listener.fileno(), self._on_accept, listener)
        self._heartbeat = loop.call_later(self.config.heartbeat_interval, self._beat)

    def set_peers(self, peers: Mapping[int, PeerAddress]) -> None:
        self._peers = dict(peers)

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

    def check_alive(self, rank: int) -> None:
        """Raise the peer's failure if it is known to be dead."""
        dead = self._dead.get(rank)
        if dead is not None:
            raise PeerFailureError(str(dead), dead.peer)

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

    def _dial(self, addr: PeerAddress, local: bool) -> socket.socket:
        """Connect, retrying errors that say nothing about the peer being gone."""
        for delay in _CONNECT_RETRY_DELAYS:
            try:
                return self._dial_once(addr, local)
            except OSError as exc:
                if exc.errno not in _TRANSIENT_CONNECT_ERRORS:
                    raise
                time.sleep(delay)  # e.g. a full accept backlog
        return self._dial_once(addr, local)

    def _dial_once(self, addr: PeerAddress, local: bool) -> socket.socket:
        timeout = self.config.connect_timeout
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
        try:
            sock = self._dial(addr, local)
        except OSError as exc:
            error = PeerFailureError(f"could not connect to {label}: {exc}", label)
            self._dead.setdefault(rank, error)
            raise error from exc
        try:
            _tune(sock)
            if cfg.client_ssl is not None and not local:
                sock = cfg.client_ssl.wrap_socket(sock, server_hostname=addr.host)
            sock.settimeout(cfg.handshake_timeout)
            client_handshake(sock, cfg.secret, cfg.rank, rank)
            sock.setblocking(False)
        except (OSError, HandshakeError) as exc:
            sock.close()
            if isinstance(exc, HandshakeError):
                raise HandshakeError(f"handshake with {label} failed: {exc}") from exc
            raise PeerFailureError(f"handshake with {label} failed: {exc}", label) from exc
        conn = Connection(self, self._io, sock, rank, label, cfg.max_message_size)
        self._conns.add(conn)
        self._opened += 1
        self._io.call_soon(conn.start)
        return conn

    # -- incoming --------------------------------------------------------------------------------
    def _on_accept(self, listener: socket.socket) -> None:
        for _ in range(16):
            try:
                sock, _addr = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                _log.warning("accept failed: %s", exc)
                return
            if self._closing or len(self._handshakes) >= _MAX_PENDING_HANDSHAKES:
                sock.close()
                continue
            sock.setblocking(False)
            is_tcp = sock.family != getattr(socket, "AF_UNIX", None)
            if is_tcp:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            _tune(sock)
            task = self._io.loop.create_task(self._handshake(sock, is_tcp))
            self._handshakes.add(task)
            task.add_done_callback(self._handshakes.discard)

    async def _handshake(self, sock: socket.socket, is_tcp: bool) -> None:
        cfg = self.config
        loop = asyncio.get_running_loop()
        try:
            peer = _peer_name(sock)
            if cfg.server_ssl is not None and is_tcp:
                sock = cfg.server_ssl.wrap_socket(
                    sock, server_side=True, do_handshake_on_connect=False
                )
                await asyncio.wait_for(tls_server_handshake(loop, sock), cfg.handshake_timeout)
            rank = await asyncio.wait_for(
                server_handshake(loop, sock, cfg.secret, cfg.rank, cfg.world_size),
                cfg.handshake_timeout,
            )
        except (HandshakeError, OSError, asyncio.TimeoutError) as exc:
            self._failed_handshakes += 1
            reason = "timed out" if isinstance(exc, asyncio.TimeoutError) else str(exc)
            _log.warning("rejected a connection from %s: handshake %s", peer, reason)
            sock.close()
            return
        if self._closing:
            sock.close()
            return
        conn = Connection(self, self._io, sock, rank, self._label(rank), cfg.max_message_size)
        self._conns.add(conn)
        self._accepted += 1
        conn.start()

    # -- callbacks from connections ---------------------------------------------------------------
    def on_frame(self, conn: Connection, frame: Frame) -> None:
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
        if not broken_protocol:
            self._dead.setdefault(conn.peer, failure)
        self._handler.on_connection_lost(conn, failure, peer_dead=not broken_protocol)

    # -- heartbeats ------------------------------------------------------------------------------
    def _beat(self) -> None:
        cfg = self.config
        now = time.monotonic()
        heartbeat = encode_frame(Kind.HEARTBEAT, 0)
        for conn in list(self._conns):
            if conn.closed:
                continue
            silent = now - conn.last_recv
            if silent > cfg.peer_timeout:
                conn.close(
                    PeerFailureError(
                        f"{conn.peer_label} sent nothing for {silent:.1f}s "
                        f"(peer timeout {cfg.peer_timeout:g}s); it is presumed dead",
                        conn.peer_label,
                    )
                )
                continue
            try:
                conn.flush_later()  # frames that waited for a write that did not come
                if now - conn.last_send >= cfg.heartbeat_interval * 0.5:
                    conn.send(heartbeat)
            except PeerFailureError:
                pass
        if not self._closing:
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
        )


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _tune(sock: socket.socket) -> None:
    for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, option, _SOCKET_BUFFER)
        except OSError:
            pass


def _peer_name(sock: socket.socket) -> str:
    try:
        name = sock.getpeername()
    except OSError:
        return "?"
    return "a local process" if isinstance(name, (str, bytes)) else f"{name[0]}:{name[1]}"
