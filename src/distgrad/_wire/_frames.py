"""Framing: how one message is laid out on a byte stream, and a parser for it.

A frame is::

    header    16 bytes  <B kind> <B flags> <H nbuffers> <I meta_len> <Q message_id>
    lengths   8 * nbuffers bytes, one little-endian u64 per out-of-band buffer
    refs      only with FLAG_BY_REFERENCE: a u64 transfer id, then one u64 address per buffer
    slots     only with FLAG_IN_RING: one u64 per buffer, its ring position + 1 (0: not there)
    meta      meta_len bytes: the pickle stream
    buffers   the out-of-band buffers, back to back (those with an address or a slot are not
              here)

A buffer with a non-zero address stays in the sender's memory; the receiver reads it directly
(``distgrad._transport._memory``, only between processes that agreed to it) and then sends a
``RELEASE`` naming the transfer id, after which the sender lets go of the memory. A buffer with
a slot lies in the connection's shared-memory ring (``distgrad._transport._ring``): the receiver
copies it out, which frees its space.

The parser validates every length against the connection's limits *before* it allocates
anything, and reads large buffers straight into memory that becomes the tensor's storage
(the socket writes into it; there is no intermediate copy). Small frames are parsed out of one
staging buffer, so a burst of small messages costs one ``recv_into`` call, not several per
frame.

The parser is pure (no sockets): the transport asks :meth:`FrameParser.get_buffer` for memory
to receive into and reports with :meth:`FrameParser.buffer_updated` how much arrived.
"""

from __future__ import annotations

import enum
import pickle
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy

from .._config import DIRECT_RECV_THRESHOLD, RECV_STAGING_SIZE
from .._errors import MessageTooLargeError, ProtocolError
from ._pickler import allocate_buffer

__all__ = [
    "FLAG_BY_REFERENCE",
    "FLAG_IN_RING",
    "HEADER",
    "MAX_BUFFERS",
    "Frame",
    "FrameParser",
    "Kind",
    "buffer_address",
    "encode_frame",
    "encode_frame_by_reference",
    "encode_frame_placed",
]

HEADER = struct.Struct("<BBHIQ")
#: At most this many out-of-band buffers in one frame (bounds the lengths block to 32 KiB).
MAX_BUFFERS = 4096
_HEADER_SIZE = HEADER.size
_unpack_header = HEADER.unpack_from


class Kind(enum.IntEnum):
    """Frame kinds. Requests and responses carry pickles; the rest are transport control."""

    REQUEST = 1
    RESPONSE = 2
    ERROR = 3
    HEARTBEAT = 4
    GOODBYE = 5
    NOTIFY = 6  # a one-way internal message: a pickle, never answered
    MEMORY_OFFER = 7  # "read my probe": u64 address + the bytes found there
    MEMORY_ACCEPT = 8  # "I can read your memory": send large buffers by reference
    RELEASE = 9  # transfer ids (u64 each) whose by-reference buffers were read
    RING_OFFER = 10  # "read my ring": u64 size, the memfd passed with it (empty: no ring)
    RING_ACCEPT = 11  # "I mapped your ring": send mid-size buffers through it


#: Frame flag (the top bit; the lower ones belong to the pickler): the frame has a refs block.
FLAG_BY_REFERENCE = 0x80
#: Frame flag: the frame has a slots block (buffers in the connection's shared-memory ring).
FLAG_IN_RING = 0x40
_TRANSPORT_FLAGS = FLAG_BY_REFERENCE | FLAG_IN_RING


_KINDS = frozenset(int(k) for k in Kind)
#: frames with up to this many buffers may take the parser's one-pass path
_WHOLE_BUFFERS = 8
_U64S = tuple(struct.Struct(f"<{n}Q") for n in range(_WHOLE_BUFFERS + 1))
_NO_SLOTS = tuple((0,) * n for n in range(_WHOLE_BUFFERS + 1))


@dataclass(slots=True)
class Frame:
    """One received message."""

    kind: int
    message_id: int
    meta: bytes | bytearray
    buffers: list[memoryview] = field(default_factory=list)
    flags: int = 0
    transfer: int = -1  # >= 0: buffers were read from the sender's memory; release this id


def encode_frame(
    kind: int,
    message_id: int,
    meta: bytes = b"",
    buffers: list[pickle.PickleBuffer] | None = None,
    flags: int = 0,
) -> list[bytes | memoryview]:
    """The pieces to write for one frame (header+meta in one piece, buffers as views)."""
    if flags & _TRANSPORT_FLAGS:
        raise ValueError("frame flags 0x80 and 0x40 are reserved for the transport")
    if not buffers:
        return [HEADER.pack(kind, flags, 0, len(meta), message_id) + meta]
    if len(buffers) == 1:  # (one tensor: the common case, without the general one's steps)
        view = buffers[0].raw()
        head = HEADER.pack(kind, flags, 1, len(meta), message_id)
        return [head + _U64S[1].pack(view.nbytes) + meta, view]
    views = [b.raw() for b in buffers]
    if len(views) > MAX_BUFFERS:
        raise ProtocolError(f"a message may carry at most {MAX_BUFFERS} tensors, got {len(views)}")
    head = HEADER.pack(kind, flags, len(views), len(meta), message_id)
    lengths = struct.pack(f"<{len(views)}Q", *(v.nbytes for v in views))
    return [head + lengths + meta, *views]


def encode_frame_by_reference(
    kind: int,
    message_id: int,
    meta: bytes,
    buffers: list[pickle.PickleBuffer],
    flags: int,
    transfer: int,
    threshold: int,
    readable: Callable[[memoryview], bool] | None = None,
) -> tuple[list[bytes | memoryview], list[memoryview]]:
    """The pieces for a frame whose buffers of at least ``threshold`` bytes stay behind (those
    that ``readable`` accepts, where given), and those buffers (to keep alive and unchanged
    until the receiver releases ``transfer``)."""
    views = [b.raw() for b in buffers]
    if len(views) > MAX_BUFFERS:
        raise ProtocolError(f"a message may carry at most {MAX_BUFFERS} tensors, got {len(views)}")
    far = [v.nbytes >= threshold and (readable is None or readable(v)) for v in views]
    kept = [v for v, away in zip(views, far, strict=True) if away]
    addresses = [buffer_address(v) if away else 0 for v, away in zip(views, far, strict=True)]
    head = HEADER.pack(kind, flags | FLAG_BY_REFERENCE, len(views), len(meta), message_id)
    table = struct.pack(f"<{2 * len(views) + 1}Q", *(v.nbytes for v in views), transfer, *addresses)
    return [head + table + meta, *(v for v, away in zip(views, far, strict=True) if not away)], kept


def encode_frame_placed(
    kind: int,
    message_id: int,
    meta: bytes,
    views: list[memoryview],
    flags: int,
    slots: list[int],
    transfer: int = -1,
    addresses: list[int] | None = None,
) -> list[bytes | memoryview]:
    """The pieces for a frame whose buffers with a non-zero slot (ring position + 1) lie in the
    connection's ring, and -- with ``addresses`` -- those with a non-zero address stay in the
    sender's memory (``transfer`` names them); the other buffers travel inline."""
    if len(views) > MAX_BUFFERS:
        raise ProtocolError(f"a message may carry at most {MAX_BUFFERS} tensors, got {len(views)}")
    lengths = [v.nbytes for v in views]
    if addresses is not None:
        flags |= FLAG_BY_REFERENCE
        table = struct.pack(f"<{3 * len(views) + 1}Q", *lengths, transfer, *addresses, *slots)
        inline = [v for v, a, s in zip(views, addresses, slots, strict=True) if not (a or s)]
    else:
        table = struct.pack(f"<{2 * len(views)}Q", *lengths, *slots)
        inline = [v for v, s in zip(views, slots, strict=True) if not s]
    head = HEADER.pack(kind, flags | FLAG_IN_RING, len(views), len(meta), message_id)
    return [head + table + meta, *inline]


def buffer_address(view: memoryview) -> int:
    """The address of the first byte of a contiguous buffer (read-only ones too)."""
    array: Any = numpy.frombuffer(view, dtype=numpy.uint8)
    return int(array.ctypes.data)


#: Reads ``view.nbytes`` bytes at an address in the sender's memory into ``view``.
RemoteReader = Callable[[int, memoryview], None]


class RingSource(Protocol):
    """Hands out a buffer of a connection's ring (``distgrad._transport._ring.RingReader``):
    the ring's memory itself, lent until the view's array dies, or a copy."""

    def take(self, position: int, n: int) -> memoryview: ...


class FrameParser:
    """Incremental frame parser over a staging buffer, with direct reads for large buffers.

    ``read_remote`` fetches buffers a frame left in the sender's memory; without it such a
    frame is a protocol error. :attr:`read_ring` (set once the connection mapped the peer's
    ring) hands out a buffer of the ring (lent or copied); a frame naming ring slots before
    then is a protocol error too.
    """

    def __init__(
        self,
        max_message_size: int,
        staging_size: int = RECV_STAGING_SIZE,
        direct_threshold: int = DIRECT_RECV_THRESHOLD,
        read_remote: RemoteReader | None = None,
    ) -> None:
        if direct_threshold > staging_size // 2:
            raise ValueError("direct_threshold must be at most half the staging size")
        self._max = max_message_size
        self._read_remote = read_remote
        self._refs: tuple[int, list[int]] | None = None  # (transfer id, addresses)
        #: hands out the buffer at a ring position (None: no ring)
        self.read_ring: RingSource | None = None
        self._slots: list[int] | None = None  # the frame's ring positions + 1 (0: not there)
        self.bytes_from_ring = 0
        self._direct_threshold = direct_threshold
        self._staging = bytearray(staging_size)
        self._view = memoryview(self._staging)
        self._start = 0  # first unparsed byte in staging
        self._end = 0  # one past the last received byte in staging
        # frame being assembled
        self._header: tuple[int, int, int, int, int] | None = None
        self._lengths: list[int] | None = None
        self._meta: bytes | bytearray | None = None
        self._buffers: list[memoryview] = []
        # a buffer being received directly: (view, filled)
        self._direct: memoryview | None = None
        self._direct_filled = 0

    # -- the transport's side -----------------------------------------------------------------
    def get_buffer(self) -> memoryview:
        """Memory to receive the next bytes into."""
        if self._direct is not None:
            return self._direct[self._direct_filled :]
        if self._end == len(self._staging):
            self._compact()
        return self._view[self._end :]

    def buffer_updated(self, nbytes: int) -> list[Frame]:
        """``nbytes`` were written into the last buffer; return the frames now complete."""
        frames: list[Frame] = []
        if self._direct is not None:
            self._direct_filled += nbytes
            if self._direct_filled < self._direct.nbytes:
                return frames
            self._finish_direct()
        else:
            self._end += nbytes
            if self._header is None:
                # Fast path: complete frames without buffers, straight out of staging (inline:
                # this is on every read's path).
                view, start, end = self._view, self._start, self._end
                limit = min(self._direct_threshold, self._max)  # larger: the general path
                while end - start >= _HEADER_SIZE:
                    kind, flags, nbuf, meta_len, message_id = _unpack_header(view, start)
                    if meta_len > limit or kind not in _KINDS:
                        break  # the general parser validates, waits, or raises
                    if nbuf:  # (a tensor-carrying message: whole, with few buffers)
                        if nbuf > _WHOLE_BUFFERS or flags & FLAG_BY_REFERENCE:
                            break
                        stop = self._parse_whole(
                            frames, start, end, kind, flags, nbuf, meta_len, message_id
                        )
                        if stop < 0:
                            break
                        start = stop
                        continue
                    stop = start + _HEADER_SIZE + meta_len
                    if stop > end:
                        break
                    frames.append(
                        Frame(kind, message_id, bytes(view[start + _HEADER_SIZE : stop]), [], flags)
                    )
                    start = stop
                self._start = start
        while self._start < self._end or self._header is not None:
            frame = self._parse_one()
            if frame is None:
                break
            frames.append(frame)
        if self._start == self._end and self._direct is None:
            self._start = self._end = 0  # drained: the next read gets the whole staging buffer
        return frames

    # -- internals ------------------------------------------------------------------------------
    def _parse_whole(
        self,
        frames: list[Frame],
        start: int,
        end: int,
        kind: int,
        flags: int,
        nbuf: int,
        meta_len: int,
        message_id: int,
    ) -> int:
        """:meth:`buffer_updated`'s fast path for a frame with buffers (a tensor-carrying
        message) that lies whole in staging: its inline buffers below the direct-read size,
        the others in the ring. Appends the frame and returns where the next one starts; -1
        (nothing consumed) where :meth:`_parse_one` must take it: the frame is incomplete, or
        something in it is for that parser to validate and refuse. After a thread's wake-up
        cold code costs more than the work at these sizes: one pass here, not the general
        parser's step per part (measured after a 0.1 ms sleep, a 1 KiB tensor's frame:
        12.4 -> 6-8 µs)."""
        view = self._view
        unpack = _U64S[nbuf].unpack_from
        position = start + _HEADER_SIZE
        if position + (16 if flags & FLAG_IN_RING else 8) * nbuf > end:
            return -1
        lengths = unpack(view, position)
        position += 8 * nbuf
        if flags & FLAG_IN_RING:
            if self.read_ring is None:
                return -1
            slots = unpack(view, position)
            position += 8 * nbuf
        else:
            slots = _NO_SLOTS[nbuf]
        total = meta_len
        stop = position + meta_len
        direct = self._direct_threshold
        for n, slot in zip(lengths, slots, strict=True):
            total += n
            if not slot:
                if n >= direct:
                    return -1
                stop += n
        if stop > end or total > self._max:
            return -1
        meta = bytes(view[position : position + meta_len])
        position += meta_len
        buffers: list[memoryview] = []
        for n, slot in zip(lengths, slots, strict=True):
            if slot:
                buffers.append(self._from_ring(slot - 1, n))
            else:
                buf = allocate_buffer(n)
                buf[:] = view[position : position + n]
                position += n
                buffers.append(buf)
        frames.append(Frame(kind, message_id, meta, buffers, flags & ~_TRANSPORT_FLAGS))
        return stop

    def _compact(self) -> None:
        pending = self._end - self._start
        if self._start:
            self._view[:pending] = self._view[self._start : self._end]
        self._start, self._end = 0, pending

    def _available(self) -> int:
        return self._end - self._start

    def _take(self, n: int) -> memoryview:
        view = self._view[self._start : self._start + n]
        self._start += n
        return view

    def _ensure_room(self, n: int) -> None:
        """Make sure staging can hold ``n`` contiguous bytes from ``_start``."""
        if self._start + n > len(self._staging):
            self._compact()

    def _parse_one(self) -> Frame | None:
        if self._direct is not None:
            return None
        if self._header is None:
            if self._available() < HEADER.size:
                self._ensure_room(HEADER.size)
                return None
            kind, flags, nbuf, meta_len, message_id = HEADER.unpack(self._take(HEADER.size))
            if kind not in _KINDS:
                raise ProtocolError(f"unknown frame kind {kind}")
            if nbuf > MAX_BUFFERS:
                raise ProtocolError(f"frame announces {nbuf} buffers; the limit is {MAX_BUFFERS}")
            if meta_len > self._max:
                raise MessageTooLargeError(
                    f"frame announces {meta_len} bytes; the maximum message size is {self._max}"
                )
            self._header = (kind, flags, nbuf, meta_len, message_id)
        kind, flags, nbuf, meta_len, message_id = self._header
        if self._lengths is None:
            need = 8 * nbuf
            if self._available() < need:
                self._ensure_room(need)
                return None
            lengths = list(struct.unpack(f"<{nbuf}Q", self._take(need))) if nbuf else []
            total = meta_len + sum(lengths)
            if total > self._max:
                raise MessageTooLargeError(
                    f"frame announces {total} bytes; the maximum message size is {self._max}"
                )
            self._lengths = lengths
            self._refs = None
            self._slots = None
        if flags & FLAG_BY_REFERENCE and self._refs is None:
            need = 8 + 8 * nbuf
            if self._available() < need:
                self._ensure_room(need)
                return None
            transfer, *addresses = struct.unpack(f"<{nbuf + 1}Q", self._take(need))
            if self._read_remote is None:
                raise ProtocolError(
                    "frame refers to buffers in the sender's memory, which this connection "
                    "did not agree to read"
                )
            self._refs = (transfer, addresses)
        if flags & FLAG_IN_RING and self._slots is None:
            need = 8 * nbuf
            if self._available() < need:
                self._ensure_room(need)
                return None
            slots = list(struct.unpack(f"<{nbuf}Q", self._take(need)))
            if self.read_ring is None:
                raise ProtocolError(
                    "frame refers to a shared-memory ring, which this connection does not have"
                )
            self._slots = slots
        if self._meta is None:
            if meta_len <= self._direct_threshold:
                if self._available() < meta_len:
                    self._ensure_room(meta_len)
                    return None
                self._meta = bytes(self._take(meta_len))
            else:
                self._start_direct(bytearray(meta_len))
                if self._direct is not None:
                    return None
        while len(self._buffers) < len(self._lengths):
            i = len(self._buffers)
            n = self._lengths[i]
            if self._slots is not None and self._slots[i]:
                if self._refs is not None and self._refs[1][i]:
                    raise ProtocolError("a buffer is said to be both in the ring and by reference")
                self._buffers.append(self._from_ring(self._slots[i] - 1, n))
            elif self._refs is not None and self._refs[1][i]:
                self._buffers.append(self._fetch(self._refs[1][i], n))
            elif n < self._direct_threshold:
                if self._available() < n:
                    self._ensure_room(n)
                    return None
                buf = allocate_buffer(n)
                buf[:] = self._take(n)
                self._buffers.append(buf)
            else:
                self._start_direct(allocate_buffer(n))
                if self._direct is not None:
                    return None
        meta = self._meta
        assert meta is not None
        frame = Frame(kind, message_id, meta, self._buffers, flags & ~_TRANSPORT_FLAGS)
        if self._refs is not None:
            frame.transfer = self._refs[0]
        self._header = self._lengths = self._meta = self._refs = self._slots = None
        self._buffers = []
        return frame

    def _fetch(self, address: int, n: int) -> memoryview:
        assert self._read_remote is not None
        buf = allocate_buffer(n)
        try:
            self._read_remote(address, buf)
        except OSError as exc:
            raise ProtocolError(f"could not read a {n}-byte buffer from the sender: {exc}") from exc
        return buf

    def _from_ring(self, position: int, n: int) -> memoryview:
        ring = self.read_ring
        if ring is None:  # (dropped with the connection meanwhile)
            raise ProtocolError("frame refers to a shared-memory ring that was dropped")
        buf = ring.take(position, n)
        self.bytes_from_ring += n
        return buf

    def _start_direct(self, target: bytearray | memoryview) -> None:
        view = memoryview(target).cast("B")
        have = min(self._available(), view.nbytes)
        view[:have] = self._take(have)
        self._direct, self._direct_filled = view, have
        if self._start == self._end:
            self._start = self._end = 0
        if have == view.nbytes:
            self._finish_direct()

    def _finish_direct(self) -> None:
        assert self._direct is not None
        done, self._direct = self._direct, None
        if self._meta is None:
            meta = done.obj  # the bytearray allocated for a large pickle stream
            assert isinstance(meta, bytearray)
            self._meta = meta
        else:
            self._buffers.append(done)
