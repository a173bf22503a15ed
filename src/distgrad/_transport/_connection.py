"""One authenticated, framed, bidirectional link to a peer over a non-blocking socket.

Writes are made directly by the thread that sends (a caller, a worker thread, or the I/O
thread), under the connection's lock: a small message costs one ``sendmsg`` and no thread
hop. Only what the socket does not take at once is queued, and the I/O thread writes the rest
when the socket becomes writable. Tensor buffers are handed to ``sendmsg`` as views of their
storage (scatter/gather) and are never joined into one bytes object.

Reads happen on the I/O thread: ``recv_into`` a buffer given by the frame parser (the staging
buffer, or a large tensor's own storage), then complete frames go to the handler -- or on a
thread that waits alone for the answer to its own call (:meth:`Connection.read_until`): one
thread holds the connection's read role at a time (``_poller``).

A Unix socket is left in blocking mode and every read and write passes ``MSG_DONTWAIT``,
except the read of a thread that holds the read role and waits for the next frame: it blocks
in ``recv`` itself (``SO_RCVTIMEO`` bounds the wait). A ``poll`` and then a ``recv`` cost a
same-host round trip ~20-25 µs more than one blocking ``recv`` (the wake-up through the poll
table, and one more system call). The blocking ``recv`` often sleeps twice per answer: when the
peer reads the frame this thread sent, the kernel wakes the socket's sleepers to say there is
room to write, and the reader sleeps again; a ``poll`` for ``POLLIN`` would not wake, but the
round trip is still slower with it (``benchmarks/README.md``, "Issue 28, sixth session").
A TCP socket's holder waits in ``poll``: over TCP a blocking ``recv`` wakes for each segment
and read 16 MiB frames ~25 % slower between two network namespaces (its eager wake-ups take
the data in smaller pieces).

Over a Unix socket, each side offers the other to read large buffers straight from its memory
(``_memory``); once the peer accepts, buffers of at least ``CROSS_MEMORY_THRESHOLD`` bytes go
by reference and are kept alive (unchanged) until the peer's ``RELEASE`` for them; and each
side passes the other a shared-memory ring (``_ring``) that carries mid-size buffers, from
``SHM_RING_THRESHOLD`` bytes up to half the ring, copied once in and once out.
"""

from __future__ import annotations

import logging
import os
import pickle
import select
import socket
import ssl
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Protocol

from .._config import CROSS_MEMORY_THRESHOLD, SHM_RING_SIZE, SHM_RING_THRESHOLD
from .._errors import FrameNotSentError, PeerFailureError, ProtocolError
from .._wire._frames import (
    FLAG_BY_REFERENCE,
    HEADER,
    Frame,
    FrameParser,
    Kind,
    buffer_address,
    encode_frame,
    encode_frame_by_reference,
    encode_frame_placed,
)
from . import _memory, _ring
from ._base import MessageInfo

if TYPE_CHECKING:
    from ._io import IoThread
    from ._poller import ReadPoller

__all__ = ["Connection", "ConnectionOwner", "Piece"]

_log = logging.getLogger("distgrad.transport")
_IOV_MAX = 512
_READS_PER_WAKEUP = 64
#: the flag that makes one read or write of a blocking socket non-blocking (Linux, macOS)
_DONTWAIT: int = getattr(socket, "MSG_DONTWAIT", 0)
_TIMEVAL = struct.Struct("@ll")
#: after a failed write, what the peer sent before it went is still read, up to this much
_DRAIN_BYTES = 64 << 20
_DRAIN_SECONDS = 1.0
#: a caller reading its own answer looks up at least this often (seconds): a call failed or
#: the connection closed by another thread meanwhile is seen within it
_READ_SLICE = 0.05
#: how long a worker that served a request waits on its connection for the next one
#: (``serve_lingering``), and how many lingers in a row may find nothing before it stops
#: lingering there (it tries again after every ``_LINGER_RETRY``-th skipped chance)
_LINGER = 0.002
_LINGER_CREDIT = 3
_LINGER_RETRY = 32
#: the smallest buffer that goes through a ring (a slot is never empty)
_RING_LOW = max(1, SHM_RING_THRESHOLD)

Piece = bytes | memoryview
_pack_header = HEADER.pack


class ConnectionOwner(Protocol):
    """What a connection reports to (the transport)."""

    def on_frame(self, conn: Connection, frame: Frame) -> None: ...

    def on_closed(self, conn: Connection, error: Exception | None) -> None: ...


def _advance(pieces: Iterable[Piece], nbytes: int) -> list[memoryview]:
    """What is left of ``pieces`` after ``nbytes`` were written."""
    rest: list[memoryview] = []
    for piece in pieces:
        view = piece if isinstance(piece, memoryview) else memoryview(piece)
        if nbytes >= view.nbytes:
            nbytes -= view.nbytes
            continue
        rest.append(view[nbytes:] if nbytes else view)
        nbytes = 0
    return rest


class Connection:
    """A framed link to ``peer``; ``send`` from any thread, reads on the I/O thread."""

    def __init__(
        self,
        owner: ConnectionOwner,
        io: IoThread,
        sock: socket.socket,
        peer: int,
        peer_label: str,
        max_message_size: int,
    ) -> None:
        self.peer = peer
        self.peer_label = peer_label
        #: the incarnation the peer presented in the handshake (0: unknown)
        self.incarnation = 0
        #: the peer's incarnation was replaced (a restart): frames still read are dropped
        #: (set by the transport, before it closes the connection)
        self.retired = False
        self._owner = owner
        #: where complete frames go: the owner, or straight to the owner's frame handler
        #: (set by the transport: no hop through it on every frame)
        self.deliver: Callable[[Connection, Frame], None] = self._to_owner
        self._io = io
        self._sock = sock
        self._fd = sock.fileno()
        self._tls = isinstance(sock, ssl.SSLSocket)
        # Every plain-socket call is non-blocking by its flags (TLS: by the socket's mode); a
        # Unix socket is blocking at the descriptor, for the read role's holder to wait in recv
        # (see the module's docstring); any other socket stays non-blocking.
        self._dontwait = 0 if self._tls else _DONTWAIT
        self._waits_in_recv = bool(_DONTWAIT) and not self._tls and sock.family == socket.AF_UNIX
        self._read_timeout = 0.0  # (SO_RCVTIMEO as last set)
        self._wait: select.poll | None = None  # (a TCP holder's poll object, kept)
        if self._waits_in_recv:
            sock.setblocking(True)
        self._lock = threading.Lock()
        self._queue: deque[memoryview] = deque()
        self._later: list[Piece] = []  # frames that go with the next write (send_later)
        self._writer_armed = False
        self._shutdown_after_flush = False
        # direct memory reads (same host): the peer's pid, our probe, what the peer accepted
        self._peer_pid = _memory.peer_pid(sock) if _memory.available() else None
        self._probe: _memory.MemoryProbe | None = None
        self._read_peer = False  # we accepted the peer's offer: it may send by reference
        self._by_reference = False  # the peer accepted ours: we may send by reference
        self._transfers = 0
        self._pinned: dict[int, list[memoryview]] = {}
        self.bytes_read_directly = 0
        self._parser = FrameParser(max_message_size, read_remote=self._read_remote)
        # the shared-memory rings (same host): ours, once the peer mapped it (``_ring_out``),
        # and the peer's, mapped (the parser's ``read_ring``). Until the peer's offer came,
        # reads take the descriptors passed with the bytes (``_fds``).
        self._ring_peer = _ring.local_peer(sock)  # (both sides offer: with a ring or without)
        self._ring_on = self._ring_peer and _ring.available()
        self._ring_offered: _ring.RingWriter | None = None
        self._ring_out: _ring.RingWriter | None = None
        self._ring_pending = self._ring_on
        self._fds: list[int] = []
        #: the one-shot set the I/O loop watches this socket through (None: the loop watches
        #: the socket itself -- TLS, or no epoll); set by the transport before :meth:`start`
        self.poller: ReadPoller | None = None
        #: the read role: held by whoever reads the socket now (the I/O thread, or a caller
        #: waiting for its answer: :meth:`read_until`)
        self.reading = threading.Lock()
        # a worker lingering on this connection for the next request (serve_lingering): the
        # frames it read that are not requests wait here for the I/O thread, in order
        self._lingering = False
        self._pending: list[Frame] = []
        self._taken: Frame | None = None  # (the request it runs itself)
        self._linger_credit = _LINGER_CREDIT
        self._linger_skipped = 0
        self._handed = False  # the read role is held for the I/O thread (_hand_pending)
        self.closed = False
        self.goodbye_received = False
        self._goodbye_sent = False
        self.close_error: Exception | None = None
        now = time.monotonic()
        self.last_recv = now
        self.last_send = now

    def _to_owner(self, conn: Connection, frame: Frame) -> None:
        self._owner.on_frame(conn, frame)

    @property
    def bytes_through_ring(self) -> int:
        """Tensor bytes taken out of the peer's ring."""
        return self._parser.bytes_from_ring

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"<Connection to {self.peer_label} fd={self._fd} {state}>"

    # -- lifecycle (I/O thread) -------------------------------------------------------------------
    def start(self) -> None:
        """Start reading; call on the I/O thread."""
        if self.closed:
            return
        if self._tls:
            self.poller = None  # (its SSL object is read and written by the I/O thread only)
        if self.poller is not None:
            self.poller.register(self._fd, self)
        else:
            self._io.loop.add_reader(self._fd, self._on_readable)
        if self._peer_pid is not None:
            self._probe = _memory.MemoryProbe()
            try:
                self.send(encode_frame(Kind.MEMORY_OFFER, 0, self._probe.offer()))
            except PeerFailureError:
                pass
        if self._ring_peer:
            self._offer_ring()

    def close(self, error: Exception | None = None) -> None:
        """Close now (any thread); ``error`` says why, ``None`` for an orderly close."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            self.close_error = error
            self._queue.clear()
            self._later.clear()
            self._pinned.clear()
            self._ring_out = self._ring_offered = None
        self._io.call_soon(self._close_in_loop, error)

    def _mark_closed(self, error: Exception) -> None:
        """Close after a failed write (any thread; the lock may be held): closed at once, but
        what the peer sent before it went -- responses, RRef messages -- still waits in the
        socket, so it is read and handed on (:meth:`_drain`) before the socket is closed."""
        if self.closed:
            return
        _log.debug("connection to %s failed: %s", self.peer_label, error)
        self.closed = True
        self.close_error = error
        self._queue.clear()
        self._later.clear()
        self._pinned.clear()
        self._ring_out = self._ring_offered = None
        self._io.call_soon(self._drain_and_close, error)

    def fail_write(self, error: PeerFailureError) -> None:
        """Close as a failed write does (fault injection: a connection found dead at write)."""
        with self._lock:
            self._mark_closed(error)

    def _drain_and_close(self, error: Exception) -> None:
        try:
            self._drain()
        finally:
            self._close_in_loop(error)

    def _drain(self) -> None:
        """Read what is already in the socket (I/O thread), bounded by ``_DRAIN_BYTES`` and
        ``_DRAIN_SECONDS``, and hand on the complete frames; stops at the first read that
        would block, the peer's EOF, or an error."""
        deadline = time.monotonic() + _DRAIN_SECONDS
        if self._handed:  # (a lingering worker's frames, queued behind this: first)
            self._hand_pending()
        if not self.reading.acquire(timeout=_DRAIN_SECONDS):
            return  # (a caller holds the read role: it reads what is there)
        try:
            total = 0
            while total < _DRAIN_BYTES and time.monotonic() < deadline:
                n = self._read_step()
                if n <= 0:
                    return
                total += n
        finally:
            self.reading.release()

    def close_when_flushed(self) -> None:
        """Say goodbye, write what is queued, then half-close; the peer's EOF finishes it."""
        try:
            self.flush_later()  # before the goodbye, after which the peer takes no work
            self._goodbye_sent = True  # before it is written: the peer's EOF may come at once
            self.send(encode_frame(Kind.GOODBYE, 0))
        except PeerFailureError:
            return
        with self._lock:
            if self.closed:
                return
            if self._queue or self._pinned:  # the peer may still read what is pinned
                self._shutdown_after_flush = True
                return
        self._half_close()

    def _half_close(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def _close_in_loop(self, error: Exception | None) -> None:
        loop = self._io.loop
        if self.poller is not None:
            self.poller.unregister(self._fd, self)
        try:
            loop.remove_reader(self._fd)
            loop.remove_writer(self._fd)
        except (ValueError, OSError):  # loop already closed, or fd gone
            pass
        try:
            self._sock.close()
        except OSError:
            pass
        self._parser.read_ring = None  # (unmapped once no reader uses it)
        fds, self._fds = self._fds, []
        for fd in fds:
            os.close(fd)
        self._owner.on_closed(self, error)

    def _fail(self, error: Exception) -> None:
        if not self.closed:
            _log.debug("connection to %s failed: %s", self.peer_label, error)
        self.close(error)

    # -- writing (any thread) -------------------------------------------------------------------
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
        """Write one frame; large buffers go by reference where the peer reads our memory --
        those the kernel lets it read (pinned CUDA host memory may not be: it goes inline) --
        and mid-size ones through our ring where the peer mapped it.
        (``info`` is for transports that choose frames by meaning; unused here.)"""
        if not buffers:
            if not flags & FLAG_BY_REFERENCE:  # (encode_frame's simplest case, inline: on
                # every small call's path)
                self.send((_pack_header(kind, flags, 0, len(meta), message_id) + meta,))
                return
        else:
            largest = max([b.raw().nbytes for b in buffers])
            if largest >= _RING_LOW and self._ring_out is not None:
                self._send_through_ring(kind, message_id, meta, buffers, flags)
                return
            if largest >= CROSS_MEMORY_THRESHOLD and self._by_reference:
                for b in buffers:
                    view = b.raw()
                    if view.nbytes >= CROSS_MEMORY_THRESHOLD and _memory.readable(view):
                        self._send_by_reference(kind, message_id, meta, buffers, flags)
                        return
        self.send(encode_frame(kind, message_id, meta, buffers, flags))

    def _send_by_reference(
        self,
        kind: int,
        message_id: int,
        meta: bytes,
        buffers: list[pickle.PickleBuffer],
        flags: int,
    ) -> None:
        with self._lock:
            transfer = self._transfers
            self._transfers += 1
        pieces, kept = encode_frame_by_reference(
            kind,
            message_id,
            meta,
            buffers,
            flags,
            transfer,
            CROSS_MEMORY_THRESHOLD,
            _memory.readable,
        )
        with self._lock:
            self._pinned[transfer] = kept
        try:
            self.send(pieces)
        except BaseException:
            with self._lock:
                self._pinned.pop(transfer, None)
            raise

    def _send_through_ring(
        self,
        kind: int,
        message_id: int,
        meta: bytes,
        buffers: list[pickle.PickleBuffer],
        flags: int,
    ) -> None:
        """:meth:`send_frame` where our ring is in use: buffers of the ring's sizes (up to its
        limit, also those past ``CROSS_MEMORY_THRESHOLD``: the ring costs one copy and no frame
        back, a direct read a system call and a ``RELEASE``) are copied into it, those it has
        no room for travel inline; larger ones go by reference as usual. Placing happens under
        the lock (one placer at a time over the chunks' bytes), before the frame naming the
        buffers is written."""
        views = [b.raw() for b in buffers]
        by_reference = self._by_reference
        ring_out = self._ring_out  # (buffers it can hold go there: one copy, none back)
        near = ring_out.limit if ring_out is not None else -1
        far = [
            by_reference
            and v.nbytes >= CROSS_MEMORY_THRESHOLD
            and v.nbytes > near
            and _memory.readable(v)
            for v in views
        ]
        transfer = -1
        if any(far):
            with self._lock:
                transfer = self._transfers
                self._transfers += 1
                self._pinned[transfer] = [v for v, f in zip(views, far, strict=True) if f]
        addresses = (
            [buffer_address(v) if f else 0 for v, f in zip(views, far, strict=True)]
            if transfer >= 0
            else None
        )

        def place() -> list[Piece]:  # (under the lock)
            ring = self._ring_out
            slots = [0] * len(views)
            try:
                if ring is not None:
                    low, high = _RING_LOW, ring.limit
                    for i, view in enumerate(views):
                        if low <= view.nbytes <= high and not far[i]:
                            slots[i] = ring.place(view) + 1  # (0: no room: inline)
                if addresses is not None or any(slots):
                    return encode_frame_placed(
                        kind, message_id, meta, views, flags, slots, transfer, addresses
                    )
            except BaseException:  # (no frame will name them: free what was placed)
                if ring is not None:
                    for slot, view in zip(slots, views, strict=True):
                        if slot:
                            ring.unplace(slot - 1, view.nbytes)
                raise
            return encode_frame(kind, message_id, meta, buffers, flags)

        try:
            self.send((), place)
        except BaseException:
            if transfer >= 0:
                with self._lock:
                    self._pinned.pop(transfer, None)
            raise

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
        """:meth:`send_later` of one frame (its buffers always travel inline)."""
        self.send_later(encode_frame(kind, message_id, meta, buffers, flags))

    def send_later(self, pieces: Sequence[Piece]) -> None:
        """Queue one frame to go out with the next write on this connection, right after that
        write's own frame, or at the latest with the transport's next heartbeat tick
        (:meth:`flush_later`): for messages nothing waits for, which then cost neither a write
        of their own nor a wake-up of the peer. Dropped if the connection closes first (between
        two workers, only when one of them is gone: the other side of a connection closed
        for a protocol error takes it for the peer's death)."""
        with self._lock:
            if self.closed:
                raise self.broken_error()
            self._later.extend(pieces)

    def flush_later(self) -> None:
        """Write the frames queued by :meth:`send_later` now, if any."""
        if self._later:
            self.send(())

    def send(
        self, pieces: Sequence[Piece], place: Callable[[], Sequence[Piece]] | None = None
    ) -> None:
        """Write one frame's pieces, in order with every other frame on this connection.
        ``place``: makes the pieces instead, under the lock (the frame names buffers it put in
        the ring: one placer at a time over the ring's chunks)."""
        with self._lock:
            if self.closed:  # nothing of this frame was written: the peer cannot have it
                error = self.broken_error()
                raise FrameNotSentError(str(error), self.peer_label)
            if place is not None:
                pieces = place()
            if self._later:
                pieces = [*pieces, *self._later]
                self._later.clear()
            elif not pieces:  # flush_later raced with another write
                return
            if self._queue:
                self._queue.extend(_advance(pieces, 0))
                return
            if self._tls and not self._io.in_loop():
                # An SSL object is not safe to use from two threads at once (OpenSSL; Python
                # runs SSL_write and SSL_read without the GIL): the I/O thread reads it, so
                # only the I/O thread writes it. Concurrent use corrupted TLS streams under
                # load ("EOF occurred in violation of protocol" on both ends).
                self._queue.extend(_advance(pieces, 0))
                if not self._writer_armed:
                    self._writer_armed = True
                    self._io.call_soon(self._arm_writer)
                return
            try:
                if self._tls:
                    written = self._write_some(pieces)
                else:  # (_write_some's plain case, inline: this is on every frame's path)
                    try:
                        if len(pieces) == 1:
                            written = self._sock.send(pieces[0], self._dontwait)
                        else:
                            written = self._sock.sendmsg(pieces[:_IOV_MAX], (), self._dontwait)
                    except (BlockingIOError, InterruptedError):
                        written = 0
            except OSError as exc:
                # Nothing was queued before this frame and the write took none of it: the
                # connection is dead and the peer cannot have the frame. Closed now (a resend
                # must find a fresh connection); what the peer sent before is still read.
                message = f"lost the connection to {self.peer_label} while sending: {exc}"
                self._mark_closed(PeerFailureError(message, self.peer_label))
                raise FrameNotSentError(message, self.peer_label) from exc
            self.last_send = time.monotonic()
            if written == (len(pieces[0]) if len(pieces) == 1 else sum(map(len, pieces))):
                return
            self._queue.extend(_advance(pieces, written))
            if not self._writer_armed:
                self._writer_armed = True
                self._io.call_soon(self._arm_writer)

    def _write_some(self, pieces: Sequence[Piece]) -> int:
        """Write as much as the socket takes now; return the number of bytes written."""
        if not self._tls:
            try:
                if len(pieces) == 1:
                    return self._sock.send(pieces[0], self._dontwait)
                return self._sock.sendmsg(pieces[:_IOV_MAX], (), self._dontwait)
            except (BlockingIOError, InterruptedError):
                return 0
        total = 0
        for piece in pieces:  # SSL sockets have no sendmsg; partial writes are enabled
            try:
                n = self._sock.send(piece)
            except (ssl.SSLWantWriteError, ssl.SSLWantReadError, BlockingIOError):
                break
            except OSError:
                if total:  # part of the frame left: the rest is queued and fails there
                    break
                raise
            total += n
            if n < len(piece):
                break
        return total

    def _arm_writer(self) -> None:
        if not self.closed:
            self._io.loop.add_writer(self._fd, self._on_writable)

    def _on_writable(self) -> None:
        with self._lock:
            try:
                while self._queue:
                    batch = [self._queue[i] for i in range(min(len(self._queue), _IOV_MAX))]
                    written = self._write_some(batch)
                    if written == 0:
                        return
                    self.last_send = time.monotonic()
                    while written:
                        head = self._queue[0]
                        if written >= head.nbytes:
                            written -= head.nbytes
                            self._queue.popleft()
                        else:
                            self._queue[0] = head[written:]
                            written = 0
            except OSError as exc:
                error: Exception = PeerFailureError(
                    f"lost the connection to {self.peer_label} while sending: {exc}",
                    self.peer_label,
                )
            else:
                self._writer_armed = False
                self._io.loop.remove_writer(self._fd)
                if self._shutdown_after_flush and not self._pinned:
                    self._half_close()
                return
        self._mark_closed(error)

    # -- direct memory reads (I/O thread) ----------------------------------------------------------
    def _read_remote(self, address: int, into: memoryview) -> None:
        """The parser's reader for buffers the peer left in its memory."""
        if not self._read_peer or self._peer_pid is None:
            raise ProtocolError(
                f"{self.peer_label} sent buffers by reference without an accepted offer"
            )
        try:
            _memory.read_memory(self._peer_pid, address, into)
        except ProcessLookupError as exc:  # the sender is gone: a dead peer, not bad input
            raise PeerFailureError(
                f"{self.peer_label} died before its message was read", self.peer_label
            ) from exc
        self.bytes_read_directly += into.nbytes

    def _on_control(self, frame: Frame) -> None:
        """Handle the connection's own frames (offers, acceptances and releases)."""
        if frame.kind == Kind.MEMORY_OFFER:
            pid = self._peer_pid
            if pid is not None and _memory.MemoryProbe.check(pid, frame.meta):
                self._read_peer = True
                try:
                    self.send(encode_frame(Kind.MEMORY_ACCEPT, 0))
                except PeerFailureError:
                    pass
            else:
                _log.debug("cannot read the memory of %s: tensors come by socket", self.peer_label)
        elif frame.kind == Kind.MEMORY_ACCEPT:
            if self._probe is None:
                raise ProtocolError(f"{self.peer_label} accepted an offer that was not made")
            self._by_reference = True
            self._probe = None
        elif frame.kind == Kind.RING_OFFER:
            self._on_ring_offer(frame)
        elif frame.kind == Kind.RING_ACCEPT:
            with self._lock:
                offered, self._ring_offered = self._ring_offered, None
                if offered is None:
                    raise ProtocolError(f"{self.peer_label} accepted a ring that was not offered")
                if not self.closed:
                    self._ring_out = offered
        else:  # RELEASE
            meta = frame.meta
            if len(meta) % 8:
                raise ProtocolError(f"malformed release from {self.peer_label}")
            with self._lock:
                for transfer in struct.unpack(f"<{len(meta) // 8}Q", meta):
                    self._pinned.pop(transfer, None)
                half_close = self._shutdown_after_flush and not self._queue and not self._pinned
            if half_close:
                self._half_close()

    def _offer_ring(self) -> None:
        """Offer the peer our ring (I/O thread, at start): the memfd goes with the offer's
        bytes (``SCM_RIGHTS``). An empty offer says there is none (the peer then stops taking
        descriptors from its reads)."""
        writer: _ring.RingWriter | None = None
        if self._ring_on:
            try:
                writer = _ring.RingWriter(-(-SHM_RING_SIZE // 4096) * 4096)  # (whole pages)
            except (OSError, ValueError) as exc:
                _log.debug("no shared-memory ring to %s: %s", self.peer_label, exc)
        try:
            if writer is not None:
                assert writer.fd is not None
                offer = encode_frame(Kind.RING_OFFER, 0, _ring.OFFER.pack(writer.size))
                # Offered before the offer leaves: the acceptance may be read at once, by a
                # thread that holds the read role, before this one runs on.
                self._ring_offered = writer
                if self._send_fd(offer, writer.fd):
                    return
                self._ring_offered = None
            self.send(encode_frame(Kind.RING_OFFER, 0))
        except PeerFailureError:
            pass
        finally:
            if writer is not None:
                writer.close_fd()  # (the peer has its own now; the mapping keeps the memory)

    def _send_fd(self, pieces: list[Piece], fd: int) -> bool:
        """Write one frame with ``fd`` passed along; False (nothing written) when it cannot be
        written at once as the next bytes on the socket."""
        with self._lock:
            if self.closed or self._queue or self._later or self._tls:
                return False
            try:
                written = self._sock.sendmsg(
                    pieces,
                    [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("i", fd))],
                    self._dontwait,
                )
            except (BlockingIOError, InterruptedError):
                return False
            except OSError as exc:
                message = f"lost the connection to {self.peer_label} while sending: {exc}"
                self._mark_closed(PeerFailureError(message, self.peer_label))
                return False
            self.last_send = time.monotonic()
            if written < sum(map(len, pieces)):
                self._queue.extend(_advance(pieces, written))
                if not self._writer_armed:
                    self._writer_armed = True
                    self._io.call_soon(self._arm_writer)
            return True

    def _on_ring_offer(self, frame: Frame) -> None:
        """The peer's ring offer (reading thread): map the ring passed with it and accept, or
        stay with the socket. Either way, reads stop taking descriptors."""
        fds, self._fds = self._fds, []
        pending, self._ring_pending = self._ring_pending, False
        try:
            if not pending or not frame.meta or self._parser.read_ring is not None:
                return  # (not wanted, no ring, or a second offer: ignored)
            if len(frame.meta) != _ring.OFFER.size or len(fds) != 1:
                raise ProtocolError(f"malformed ring offer from {self.peer_label}")
            try:
                reader = _ring.RingReader(fds[0], _ring.OFFER.unpack(frame.meta)[0])
            except OSError as exc:
                _log.debug("cannot map the ring of %s: %s", self.peer_label, exc)
                return
            self._parser.read_ring = reader
            try:
                self.send(encode_frame(Kind.RING_ACCEPT, 0))
            except PeerFailureError:
                pass
        finally:
            for fd in fds:
                os.close(fd)

    def _release(self, transfers: list[int]) -> None:
        try:
            self.send(encode_frame(Kind.RELEASE, 0, struct.pack(f"<{len(transfers)}Q", *transfers)))
        except PeerFailureError:
            pass

    # -- reading (I/O thread, or a caller waiting for its answer) --------------------------------
    def on_poll(self) -> None:
        """The socket has data (I/O thread, through the poller): read it unless a caller holds
        the read role (it re-arms the socket when it gives the role back)."""
        if not self.reading.acquire(blocking=False):
            return
        try:
            self._on_readable()
        finally:
            self.reading.release()
        poller = self.poller
        if poller is not None and not self.closed:
            try:  # (the set's modify, inline: this is on every call's path)
                poller.modify(self._fd, poller.events)
            except (OSError, ValueError):  # unregistered (closed), or the set is closed
                pass

    def hold_read(self) -> bool:
        """Take the read role now (the I/O thread stops watching the socket) for a
        :meth:`read_until` or :meth:`serve_lingering` to come -- taken before a request or a
        reply is written, so that its answer cannot reach the I/O thread first. False if it
        cannot be taken (TLS, no poller, closed, or another thread holds it)."""
        poller = self.poller
        if poller is None or self._tls or self.closed:
            return False
        if not self.reading.acquire(blocking=False):
            return False
        try:  # (the set's modify, inline: this is on every call's path)
            poller.modify(self._fd, 0)
        except (OSError, ValueError):  # unregistered (closed), or the set is closed
            pass
        return True

    def release_read(self) -> None:
        """Give back a read role taken by :meth:`hold_read` and not used."""
        self.reading.release()
        poller = self.poller
        if poller is not None and not self.closed:
            try:  # (the set's modify, inline: this is on every call's path)
                poller.modify(self._fd, poller.events)
            except (OSError, ValueError):  # unregistered (closed), or the set is closed
                pass

    def read_until(self, lock: threading.Lock, timeout: float, *, held: bool = False) -> bool:
        """Wait for ``lock`` (an answer's: released by whoever hands the answer on) by reading
        this connection on the calling thread: a caller waiting alone reads its own answer,
        and every frame that comes before it, with no other thread woken. Returns True once
        ``lock`` is acquired; False at once if another thread holds the read role (or the
        loop watches the socket itself), and False when ``timeout`` seconds (> 0) passed or
        the connection closed -- the caller then waits for ``lock`` as usual. ``held``: the
        caller took the role already (:meth:`hold_read`); it is given back either way."""
        poller = self.poller
        if not held and not self.hold_read():
            return False
        assert poller is not None
        fd = self._fd
        try:
            deadline = time.monotonic() + timeout if timeout > 0 else None
            while not lock.acquire(blocking=False):
                if self.closed:
                    return False
                wait = _READ_SLICE
                if deadline is not None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return False
                    wait = min(wait, left)
                # (inline, not through a helper: this is on every rpc_sync's path)
                got = self._read_step(wait) if self._waits_in_recv else self._poll_then_read(wait)
                if got > 0:
                    while self._read_step() > 0:
                        pass
            return True
        finally:
            self.reading.release()
            if not self.closed:
                try:  # (the set's modify, inline: this is on every call's path)
                    poller.modify(fd, poller.events)
                except (OSError, ValueError):  # unregistered (closed), or the set is closed
                    pass

    def serve_lingering(self, *, held: bool = False) -> Frame | None:
        """On a worker that served a request from this connection: wait a moment
        (``_LINGER``) for the next frame on this thread, and read what came. The first
        request read is returned, not handed on: the worker runs it itself, so that a peer
        that calls again at once wakes this worker only, not the I/O thread and then a
        worker; further requests, and notifications, are handed on here, in order; after
        notifications alone it lingers on for the rest of the time. Any other frame (an
        answer, a goodbye), and everything after it in that read, goes to the I/O thread in
        order, as if it had read them. ``None``: no request came. A connection where
        lingering keeps finding nothing is not lingered on for a while. ``held``: the worker
        took the role already (:meth:`hold_read`); it is given back either way."""
        poller = self.poller
        if self._linger_credit <= 0:
            self._linger_skipped += 1
            if self._linger_skipped < _LINGER_RETRY:
                if held:
                    self.release_read()
                return None
            self._linger_skipped = 0
            self._linger_credit = 1
        if not held and not self.hold_read():
            return None
        assert poller is not None
        fd = self._fd
        taken = None
        try:
            deadline = time.monotonic() + _LINGER
            left = _LINGER
            while True:
                self._lingering = True
                got = self._read_step(left) if self._waits_in_recv else self._poll_then_read(left)
                if got > 0:
                    while self._read_step() > 0:
                        pass
                self._lingering = False
                if self._taken is not None or self._pending or self.closed:
                    break
                # Nothing came, part of a frame, or only notifications (handed on here, in
                # order: a context's cleanup after its last gradient message, typically):
                # linger on for the rest of the time, for the request that usually follows.
                left = deadline - time.monotonic()
                if left <= 0:
                    break
        finally:
            self._lingering = False
            taken, self._taken = self._taken, None
            if taken is not None:
                self._linger_credit = min(_LINGER_CREDIT, self._linger_credit + 1)
            else:
                self._linger_credit -= 1
            if self._pending:
                self._handed = True
                self._io.call_soon(self._hand_pending)  # (it gives the read role back)
            else:
                self.reading.release()
                if not self.closed:
                    try:  # (the set's modify, inline: this is on every call's path)
                        poller.modify(fd, poller.events)
                    except (OSError, ValueError):  # unregistered (closed), or the set is closed
                        pass
        return taken

    def _hand_pending(self) -> None:
        """I/O thread: hand on the frames a lingering worker left, then give the read role
        back (held for this since the worker read them) and re-arm the socket."""
        if not self._handed:
            return
        self._handed = False
        frames, self._pending = self._pending, []
        try:
            for frame in frames:
                if frame.kind == Kind.GOODBYE:
                    self.goodbye_received = True
                    continue
                if self.retired:
                    continue  # (as _read_step)
                try:
                    self.deliver(self, frame)
                except Exception:
                    _log.exception("error while handling a frame from %s", self.peer_label)
        finally:
            self.reading.release()
            poller = self.poller
            if poller is not None and not self.closed:
                try:  # (the set's modify, inline: this is on every call's path)
                    poller.modify(self._fd, poller.events)
                except (OSError, ValueError):  # unregistered (closed), or the set is closed
                    pass

    def _on_readable(self) -> None:
        for _ in range(_READS_PER_WAKEUP):
            if self._read_step() <= 0:
                return
        # Out of reads for this wake-up. Bytes TLS has already taken from the kernel (a
        # record's decrypted rest) wake no reader: come back for them after the other work.
        if self._tls and not self.closed and self._sock.pending():  # type: ignore[attr-defined]
            self._io.loop.call_soon(self._on_readable)

    def _poll_then_read(self, seconds: float) -> int:
        """The read role's holder on a socket that does not wait in ``recv`` (TCP): wait at
        most ``seconds`` in ``poll``, then read as :meth:`_read_step` (0: nothing came)."""
        wait = self._wait
        if wait is None:
            wait = self._wait = select.poll()
            wait.register(self._fd, select.POLLIN)
        if not wait.poll(max(1, int(seconds * 1000))):
            return 0
        return self._read_step()

    def _set_read_timeout(self, seconds: float) -> None:
        """``SO_RCVTIMEO``: a waiting read returns after ``seconds`` (the kernel rounds it up
        to its clock tick)."""
        self._read_timeout = seconds
        whole = int(seconds)
        micro = int((seconds - whole) * 1e6) or (0 if whole else 1)  # (0 would be forever)
        try:
            self._sock.setsockopt(
                socket.SOL_SOCKET, socket.SO_RCVTIMEO, _TIMEVAL.pack(whole, micro)
            )
        except OSError:  # (closed meanwhile: the read says so)
            pass

    def _read_step(self, wait: float = 0.0) -> int:
        """One read, and the frames it completes handed on; returns the bytes read, 0 when
        there is nothing more to read now, -1 when the connection ended. ``wait`` > 0: block
        in the read until something comes, at most ``wait`` seconds (only the read role's
        holder, on a socket that ``_waits_in_recv``)."""
        parser = self._parser
        buf = parser.get_buffer()
        if wait:
            if wait != self._read_timeout:
                self._set_read_timeout(wait)
            flags = 0
        else:
            flags = self._dontwait
        try:
            if self._tls:
                n = self._recv_tls(buf)
            elif self._ring_pending:  # (the peer's ring may come with these bytes)
                n = _ring.receive_fds(self._sock, buf, self._fds, flags)
            else:
                n = self._sock.recv_into(buf, 0, flags)
        except (BlockingIOError, InterruptedError, ssl.SSLWantReadError):
            return 0
        except ssl.SSLWantWriteError:
            return 0
        except OSError as exc:
            message = f"lost the connection to {self.peer_label}: {exc}"
            self._fail(PeerFailureError(message, self.peer_label))
            return -1
        if n == 0:
            self._on_eof()
            return -1
        self.last_recv = time.monotonic()
        try:
            frames = parser.buffer_updated(n)
            released: list[int] = []
            for frame in frames:  # (a loop, not a comprehension: no call on the read path)
                if frame.transfer >= 0:
                    released.append(frame.transfer)
            if released:  # the reads are done: let the peer reuse that memory at once
                self._release(released)
            for frame in frames:
                if frame.kind >= Kind.MEMORY_OFFER:
                    self._on_control(frame)
        except ProtocolError as exc:
            _log.warning("dropping connection from %s: %s", self.peer_label, exc)
            self._fail(exc)
            return -1
        except PeerFailureError as exc:
            self._fail(exc)
            return -1
        for frame in frames:
            if frame.kind == Kind.HEARTBEAT or frame.kind >= Kind.MEMORY_OFFER:
                continue
            if self._lingering:
                kind = frame.kind
                if self._pending or kind not in (Kind.REQUEST, Kind.NOTIFY):
                    self._pending.append(frame)  # (for the I/O thread, in order)
                    continue
                if kind == Kind.REQUEST and self._taken is None and not self.retired:
                    self._taken = frame  # (the lingering worker runs it itself)
                    continue
            if frame.kind == Kind.GOODBYE:
                self.goodbye_received = True
                continue
            if self.retired:
                continue  # a frame of a replaced incarnation (its connection is closing)
            try:
                self.deliver(self, frame)
            except Exception:
                _log.exception("error while handling a frame from %s", self.peer_label)
        if n < len(buf) and not (self._tls and self._sock.pending()):  # type: ignore[attr-defined]
            return 0
        return n

    def _recv_tls(self, buf: memoryview) -> int:
        """Fill ``buf`` with what TLS has now: one SSL read returns at most one record (16
        KiB), so a large frame would otherwise cost the parser a step per record. Raises as
        ``recv_into`` when nothing could be read."""
        view = buf
        size = len(view)
        total = 0
        while total < size:
            try:
                n = self._sock.recv_into(view[total:])
            except (BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
                if total:
                    return total
                raise
            if n == 0:  # EOF: hand over what came before it; the next read reports it
                return total
            total += n
        return total

    def _on_eof(self) -> None:
        # After our goodbye, the peer's EOF is the orderly end even without its own goodbye: a
        # peer that got ours closes the connection at once, without answering it.
        if self.goodbye_received or self._goodbye_sent:
            self.close(None)
        else:
            self._fail(
                PeerFailureError(
                    f"{self.peer_label} closed the connection unexpectedly (did it die?)",
                    self.peer_label,
                )
            )

    def readable_now(self) -> bool:
        """True if the kernel holds data from the peer not read yet (this process was slow to
        read it: the peer is not silent)."""
        try:
            readable, _, _ = select.select([self._sock.fileno()], [], [], 0)
        except (OSError, ValueError):
            return False
        return bool(readable)

    def broken_error(self) -> PeerFailureError:
        """The error for a send on (or a wait for) this closed connection."""
        if self.close_error is not None and isinstance(self.close_error, PeerFailureError):
            return PeerFailureError(str(self.close_error), self.peer_label)
        if self.goodbye_received:
            return PeerFailureError(f"{self.peer_label} has shut down", self.peer_label)
        reason = f": {self.close_error}" if self.close_error else ""
        return PeerFailureError(
            f"the connection to {self.peer_label} is closed{reason}", self.peer_label
        )
