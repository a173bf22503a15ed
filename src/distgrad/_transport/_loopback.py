"""The connection of a worker to itself (RPC to self is a real RPC: frames are handed over
with their buffers copied, as if they had crossed a socket)."""

from __future__ import annotations

import pickle
from collections.abc import Callable

from .._errors import RpcShutdownError
from .._wire._frames import HEADER, Frame, encode_frame
from .._wire._pickler import allocate_buffer
from ._base import MessageInfo
from ._connection import Piece

__all__ = ["LoopbackConnection"]


class LoopbackConnection:
    """A connection to this very worker: frames are handed over with their buffers copied,
    exactly as if they had crossed a socket (RPC to self is a real RPC)."""

    closed = False

    def broken_error(self) -> RpcShutdownError:
        return RpcShutdownError("RPC agent is shut down")

    def close(self, error: Exception | None = None) -> None:
        self.closed = True

    def __init__(
        self, deliver: Callable[[LoopbackConnection, Frame], None], rank: int, label: str
    ) -> None:
        self.peer = rank
        self.peer_label = label
        self._deliver = deliver  # the transport's: hands a frame to the agent

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
        self._deliver(self, Frame(kind, message_id, meta, buffers, flags))
