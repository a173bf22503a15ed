"""The socket transport's incoming side: accepting connections, the pending-handshake limit
(a silent connection gives its slot to one that spoke), TLS and the server handshake."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable

from .._errors import HandshakeError
from .._wire._frames import Frame
from ._base import TransportConfig
from ._connection import Connection, ConnectionOwner
from ._dialing import _tune
from ._handshake import server_accept, tls_server_handshake, wait_readable
from ._io import IoThread
from ._poller import ReadPoller

__all__ = ["Accepting"]

_log = logging.getLogger("distgrad.transport")
_MAX_PENDING_HANDSHAKES = 128
# Connections accepted per wake-up of the I/O loop at most (the listen backlog): enough to
# drain a full backlog, so a flood does not keep it full for the peers behind it.
_ACCEPTS_PER_WAKEUP = 512


class Accepting:
    """:class:`~._transport.SocketTransport`'s accepting of connections: a stage the transport
    makes and hands what it uses. It owns the pending handshakes and counts the connections
    it accepted (:attr:`accepted`) and the handshakes that failed (:attr:`failed_handshakes`);
    once :attr:`closing` is set it accepts nothing more."""

    def __init__(
        self,
        config: TransportConfig,
        io: IoThread,
        owner: ConnectionOwner,
        *,
        label: Callable[[int], str],
        note_incarnation: Callable[[int, int], bool],
        conns: set[Connection],
        poller: ReadPoller | None,
        deliver: Callable[[Connection, Frame], None],
    ) -> None:
        self._config = config
        self._io = io
        #: what the connections accepted here report to (the transport)
        self._owner = owner
        #: how a peer is named in errors
        self._label = label
        #: records the incarnation a peer presented; False for a replaced one
        self._note_incarnation = note_incarnation
        #: the transport's open connections: those accepted here join them
        self._conns = conns
        #: the one-shot set the loop reads plain connections through (None: none)
        self._poller = poller
        #: where their complete frames go (the transport's frame handler, straight)
        self._deliver = deliver
        self.handshakes: set[asyncio.Task[None]] = set()
        # pending handshakes whose peer has sent nothing yet (oldest first), and those of them
        # ended to make room for a connection that had (see on_accept)
        self._silent: dict[asyncio.Task[None], socket.socket] = {}
        self._shed: set[asyncio.Task[None]] = set()
        #: set when the transport closes: nothing more is accepted
        self.closing = False
        self.accepted = 0
        self.failed_handshakes = 0

    def cancel_handshakes(self) -> None:
        """End every pending handshake (the transport stops listening; I/O thread)."""
        for task in list(self.handshakes):
            task.cancel()

    # -- incoming --------------------------------------------------------------------------------
    def on_accept(self, listener: socket.socket) -> None:
        for _ in range(_ACCEPTS_PER_WAKEUP):
            try:
                sock, _addr = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                _log.warning("accept failed: %s", exc)
                return
            if self.closing:
                sock.close()
                continue
            sock.setblocking(False)
            # Every handshake slot taken: a connection whose first bytes have arrived takes the
            # slot of the oldest one that has said nothing yet (so a flood of silent
            # connections cannot keep peers out); any other is closed at once.
            if len(self.handshakes) >= _MAX_PENDING_HANDSHAKES and not (
                _has_spoken(sock) and self._shed_silent()
            ):
                sock.close()
                continue
            is_tcp = sock.family != getattr(socket, "AF_UNIX", None)
            if is_tcp:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            _tune(sock)
            task = self._io.loop.create_task(self._handshake(sock, is_tcp))
            self.handshakes.add(task)
            self._silent[task] = sock
            task.add_done_callback(self.handshakes.discard)

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
        cfg = self._config
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
            self.failed_handshakes += 1
            reason = "timed out" if isinstance(exc, asyncio.TimeoutError) else str(exc)
            _log.warning("rejected a connection from %s: handshake %s", peer, reason)
            sock.close()
            return
        if self.closing or not self._note_incarnation(rank, incarnation):
            sock.close()  # (a replaced incarnation: nothing of it is delivered)
            return
        conn = Connection(
            self._owner, self._io, sock, rank, self._label(rank), cfg.max_message_size
        )
        conn.incarnation = incarnation
        conn.poller = self._poller
        conn.deliver = self._deliver
        self._conns.add(conn)
        self.accepted += 1
        conn.start()


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
