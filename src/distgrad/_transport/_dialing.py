"""The socket transport's outgoing side: dialing a peer (Unix socket or TCP, retrying what says
nothing about the peer), TLS and the client handshake, and what a failure proves."""

from __future__ import annotations

import errno
import socket
import ssl
import time
from collections.abc import Callable, Mapping

from .._errors import DistgradError, HandshakeError, PeerFailureError
from .._wire._frames import Frame
from ._base import PeerAddress, TransportConfig
from ._connection import Connection, ConnectionOwner
from ._handshake import PeerClosedHandshake, client_handshake
from ._io import IoThread
from ._poller import ReadPoller
from ._suspicion import PeerVerdicts

__all__ = ["Dialing"]

_SOCKET_BUFFER = 4 * 1024 * 1024
# The one connect error that proves a peer gone: a refusal (nothing listens at its address;
# after the rendezvous every worker listens until it shuts down). Anything else -- a full
# accept backlog (EAGAIN on a Unix socket, which a flooding local process can cause), a
# timeout, an unreachable network -- fails the call that was connecting, never the peer.
_REFUSED = frozenset({errno.ECONNREFUSED})
# Connect errors that say nothing about the peer; retried after these pauses.
_TRANSIENT_CONNECT_ERRORS = frozenset(
    {errno.EAGAIN, errno.EINTR, errno.ETIMEDOUT, errno.ENOBUFS, errno.EADDRNOTAVAIL}
)
_CONNECT_RETRY_DELAYS = (0.05, 0.2, 0.5)
_HANDSHAKE_RETRY_DELAYS = (0.1, 0.25, 0.5, 1.0)


class Dialing:
    """:class:`~._transport.SocketTransport`'s connecting to its peers: a stage the transport
    makes and hands what it uses; it counts the connections it opened (:attr:`opened`)."""

    def __init__(
        self,
        config: TransportConfig,
        io: IoThread,
        owner: ConnectionOwner,
        *,
        label: Callable[[int], str],
        note_incarnation: Callable[[int, int], bool],
        peers: Mapping[int, PeerAddress],
        conns: set[Connection],
        poller: ReadPoller | None,
        deliver: Callable[[Connection, Frame], None],
        verdicts: PeerVerdicts,
        host_id: str,
    ) -> None:
        self._config = config
        self._io = io
        #: what the connections opened here report to (the transport)
        self._owner = owner
        #: how a peer is named in errors
        self._label = label
        #: records the incarnation a peer presented; False for a replaced one
        self._note_incarnation = note_incarnation
        #: where the peers listen (the transport's, kept up to date there)
        self._peers = peers
        #: the transport's open connections: those opened here join them
        self._conns = conns
        #: the one-shot set the loop reads plain connections through (None: none)
        self._poller = poller
        #: where their complete frames go (the transport's frame handler, straight)
        self._deliver = deliver
        self._verdicts = verdicts
        self._host_id = host_id
        #: connections opened so far
        self.opened = 0

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

    def open(self, rank: int) -> Connection:
        addr = self._peers.get(rank)
        label = self._label(rank)
        if addr is None:
            raise PeerFailureError(f"no address known for {label}", label)
        cfg = self._config
        local = cfg.use_unix_sockets and addr.unix is not None and addr.host_id == self._host_id
        # a suspected peer may be frozen or cut off: do not wait longer than its silence took
        suspected = self._verdicts.is_suspected(rank)
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
                if isinstance(failure, PeerFailureError):
                    # (a frozen peer: its kernel accepts the connection, the process is silent)
                    self._verdicts.reconnect_failed(rank, failure)
                raise failure from exc
        if not self._note_incarnation(rank, incarnation):
            sock.close()
            raise PeerFailureError(f"{label} answered as an incarnation that was replaced", label)
        self._verdicts.answered(rank)  # back: it answered a fresh handshake
        conn = Connection(self._owner, self._io, sock, rank, label, cfg.max_message_size)
        conn.incarnation = incarnation
        conn.poller = self._poller
        conn.deliver = self._deliver
        self._conns.add(conn)
        self.opened += 1
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
                self._verdicts.prove_dead(rank, error, "refused")
            else:  # says nothing about the peer: this call fails, the next one tries again
                error = PeerFailureError(
                    f"could not connect to {label}: {exc} (not presumed dead: a later call "
                    "connects again)",
                    label,
                )
                self._verdicts.reconnect_failed(rank, error)
            raise error from exc
        return sock, not local


def _tune(sock: socket.socket) -> None:
    """Large socket buffers for a Unix socket (its default, ~200 KiB, splits a large frame
    into many wake-ups). A TCP socket keeps the kernel's buffer autotuning, which setting
    a size turns off: between two network-namespace hosts it grows past 4 MiB and carried
    16-64 MiB echoes 10-25 % faster (`rpc_bench.py --netns`, issue 28)."""
    if sock.family != getattr(socket, "AF_UNIX", None):
        return
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
