"""The socket transport's incoming side: accepting connections, the pending-handshake limit
(a silent connection gives its slot to one that spoke), TLS and the server handshake."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable
from typing import TYPE_CHECKING

from .._errors import HandshakeError
from .._wire._frames import Frame
from ._base import TransportConfig
from ._connection import Connection
from ._dialing import _tune
from ._handshake import server_accept, tls_server_handshake, wait_readable
from ._io import IoThread

__all__ = ["Accepting"]

_log = logging.getLogger("distgrad.transport")
_MAX_PENDING_HANDSHAKES = 128
# Connections accepted per wake-up of the I/O loop at most (the listen backlog): enough to
# drain a full backlog, so a flood does not keep it full for the peers behind it.
_ACCEPTS_PER_WAKEUP = 512


class Accepting:
    """:class:`~._transport.SocketTransport`'s accepting of connections (a mixin)."""

    config: TransportConfig
    _io: IoThread
    _label: Callable[[int], str]
    _conns: set[Connection]
    _handshakes: set[asyncio.Task[None]]
    _silent: dict[asyncio.Task[None], socket.socket]
    _shed: set[asyncio.Task[None]]
    _closing: bool
    _accepted: int
    _failed_handshakes: int

    if TYPE_CHECKING:  # (SocketTransport's)

        def note_incarnation(self, rank: int, incarnation: int) -> bool: ...

        def on_frame(self, conn: Connection, frame: Frame) -> None: ...

        def on_closed(self, conn: Connection, error: Exception | None) -> None: ...

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
