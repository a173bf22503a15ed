"""One link of the in-memory transport (:class:`MemoryLink`): a frame's bytes copied at send time
and parsed on the receiver's I/O thread, as a socket connection's; its end seen by the other
side as an end of stream. The transport and the network are ``_inmemory``'s (above this module:
a link knows its transport only as a :class:`LinkOwner`)."""

from __future__ import annotations

import logging
import pickle
import threading
import time
from collections.abc import Callable
from typing import Protocol

from .._errors import PeerFailureError, ProtocolError
from .._wire._frames import Frame, FrameParser, Kind, encode_frame
from ._base import FrameHandler, MessageInfo, TransportConfig
from ._io import IoThread

__all__ = ["LinkOwner", "MemoryLink"]


class LinkOwner(Protocol):
    """What a link uses of its transport (``_inmemory.MemoryTransport``)."""

    @property
    def config(self) -> TransportConfig: ...

    @property
    def io(self) -> IoThread: ...

    @property
    def handler(self) -> FrameHandler: ...

    @property
    def paused(self) -> bool:
        """Frozen (fault injection): what the link sends or receives waits in :meth:`hold`."""
        ...

    def hold(self, incoming: bool, fn: Callable[..., None], *args: object) -> bool:
        """While paused, keep ``fn(*args)`` for the resume; False when not paused."""
        ...

    def is_current(self, link: MemoryLink) -> bool:
        """Whether ``link`` is still its transport's link to that peer."""
        ...

    def _on_closed(self, link: MemoryLink, error: Exception | None) -> None: ...


_log = logging.getLogger("distgrad.transport")


class MemoryLink:
    """One end of an in-memory connection; ``send_frame`` from any thread."""

    def __init__(self, transport: LinkOwner, peer: int, peer_label: str) -> None:
        self.peer = peer
        self.peer_label = peer_label
        #: the incarnation of the peer's agent this link was opened with (0: unknown)
        self.incarnation = 0
        self._transport = transport
        self.other: MemoryLink | None = None
        self._lock = threading.Lock()
        self._later: list[bytes] = []
        self._parser = FrameParser(transport.config.max_message_size)
        self._closed = False
        #: closed by a failed write (:meth:`fail_write`): its peer is not condemned
        self.write_failed = False
        self.goodbye_received = False
        self.close_error: Exception | None = None
        self.last_recv = self.last_send = time.monotonic()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<MemoryLink to {self.peer_label} {state}>"

    @property
    def closed(self) -> bool:
        return self._closed

    # -- sending (any thread) ----------------------------------------------------------------------
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
        self.send_bytes(_join(kind, message_id, meta, buffers, flags))

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
        data = _join(kind, message_id, meta, buffers, flags)
        with self._lock:
            if self._closed:
                raise self.broken_error()
            self._later.append(data)

    def flush_later(self) -> None:
        if self._later:
            self.send_bytes(b"")

    def send_bytes(self, data: bytes) -> None:
        """Hand encoded frames to the other end, in order with every other send on this link."""
        with self._lock:
            if self._closed:
                raise self.broken_error()
            if self._later:
                data = b"".join([data, *self._later])
                self._later.clear()
            if not data:
                return
            if self._transport.paused and self._transport.hold(False, self.send_bytes, data):
                return  # frozen: it goes out when the worker is resumed
            other = self.other
            assert other is not None
            try:
                other._transport.io.call_soon(other._receive, data)
            except RuntimeError as exc:  # its loop is closed: it is gone
                raise PeerFailureError(
                    f"lost the connection to {self.peer_label} while sending: {exc}",
                    self.peer_label,
                ) from exc
            self.last_send = time.monotonic()

    # -- receiving (this end's I/O thread) ---------------------------------------------------------
    def _receive(self, data: bytes) -> None:
        if self._transport.paused and self._transport.hold(True, self._receive, data):
            return
        if self._closed:
            return
        self.last_recv = time.monotonic()
        parser = self._parser
        view = memoryview(data)
        frames: list[Frame] = []
        position = 0
        try:
            while position < len(view):
                buf = parser.get_buffer()
                n = min(len(buf), len(view) - position)
                buf[:n] = view[position : position + n]
                position += n
                frames.extend(parser.buffer_updated(n))
        except ProtocolError as exc:
            _log.warning("dropping connection from %s: %s", self.peer_label, exc)
            self.close(exc)
            return
        handler = self._transport.handler
        if not self._transport.is_current(self):
            return  # frames of a replaced incarnation are never delivered
        for frame in frames:
            if frame.kind == Kind.HEARTBEAT:
                continue
            if frame.kind == Kind.GOODBYE:
                self.goodbye_received = True
                continue
            try:
                handler.on_frame(self, frame)
            except Exception:
                _log.exception("error while handling a frame from %s", self.peer_label)

    def _on_eof(self) -> None:
        """The other end closed (after everything it sent was received)."""
        if self._transport.paused and self._transport.hold(True, self._on_eof):
            return
        if self.goodbye_received:
            self.close(None)
        else:
            self.close(
                PeerFailureError(
                    f"{self.peer_label} closed the connection unexpectedly (did it die?)",
                    self.peer_label,
                )
            )

    # -- closing -----------------------------------------------------------------------------------
    def fail_write(self, error: PeerFailureError) -> None:
        """Close as a socket whose write failed (the peer reset it): the peer is suspected, not
        condemned -- a write failure proves nothing -- so a later send connects again."""
        self.write_failed = True
        if self.other is not None:  # (it reset the link: neither side proves anything)
            self.other.write_failed = True
        self.close(error)

    def close(self, error: Exception | None = None) -> None:
        """Close this end now (any thread); the other end sees the end of the stream."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self.close_error = error
            self._later.clear()
        other = self.other
        if other is not None:
            try:
                other._transport.io.call_soon(other._on_eof)
            except RuntimeError:
                pass  # its loop is gone already
        try:
            self._transport.io.call_soon(self._transport._on_closed, self, error)
        except RuntimeError:
            pass

    def broken_error(self) -> PeerFailureError:
        if isinstance(self.close_error, PeerFailureError):
            return PeerFailureError(str(self.close_error), self.peer_label)
        if self.goodbye_received:
            return PeerFailureError(f"{self.peer_label} has shut down", self.peer_label)
        reason = f": {self.close_error}" if self.close_error else ""
        return PeerFailureError(
            f"the connection to {self.peer_label} is closed{reason}", self.peer_label
        )


def _join(
    kind: int,
    message_id: int,
    meta: bytes,
    buffers: list[pickle.PickleBuffer] | None,
    flags: int,
) -> bytes:
    """The frame's bytes, copied now (the sender may reuse its tensors once the send returned)."""
    return b"".join(encode_frame(kind, message_id, meta, buffers, flags))
