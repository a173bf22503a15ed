"""A shared-memory ring per same-host connection direction: mid-size tensors copied once.

Through a Unix socket a tensor is copied twice (into the kernel by ``sendmsg``, out of it by
``recv_into``) with system calls and socket-buffer bookkeeping on both sides. Direct reads
(``_memory``) pay off from 4 MiB; below that one ``process_vm_readv`` per buffer and a
``RELEASE`` frame per message cost more than the socket's second copy. A fresh memfd per
message loses too (fresh shmem pages are zeroed and faulted in one by one). So the sender of
each same-host connection direction makes *one* memfd, passes it to the receiver over the Unix
socket (``SCM_RIGHTS``, after the authenticated handshake) and reuses it for the connection's
life: its pages are faulted in once, at the first message that uses it. A buffer then costs
one ``memmove`` into the ring on the sender, and -- from 256 KiB (:data:`LEND_FROM`) --
nothing on the receiver: the received tensor's storage *is* the buffer's place in the ring (it
is *lent*), and its space is freed when that tensor dies (smaller buffers are copied out, as
cheap there, and freed at once). The frame on the socket carries the buffer's position instead
of its bytes. No system call beyond the frame, no frame back. (``DISTGRAD_SHM_RING_LEND=0``
makes the receiver copy each buffer out and free its space at once instead.)

Layout: a header of one byte per 4 KiB *chunk* of data (rounded up to whole pages), then
``size`` bytes of data. A buffer lies at a chunk's start (its position: a byte offset into the
data) and takes whole chunks. A chunk's byte is 0 while it is free and 1 while a buffer holds
it; the sender sets it (0 -> 1, when it places a buffer there), the receiver clears it (1 -> 0,
when the buffer's tensor died, or at once after its copy) -- each transition has one writer.
Buffers are freed in any order: a tensor the receiver keeps (a replay buffer, a gradient kept
until its context is released) holds its chunks and no more, and at most half the ring is lent
at once (past that, buffers are copied out and freed at once: tensors kept for long never take
the whole ring from the traffic); the sender places the next
buffers in the first run of free chunks that fits (first fit: recently freed memory is the
most likely still in a cache), and a buffer that finds none travels inline.

Memory ordering, both directions:

* sender -> receiver: the sender copies the buffer into the ring *before* it writes the frame
  naming it; the receiver reads it only *after* it read that frame. The socket write and read
  pair is the barrier: the kernel queues and dequeues the frame under the socket's lock (a
  release on the sending CPU, an acquire on the receiving one), so every store the sender made
  before ``sendmsg`` is visible to the receiver after its ``recv`` returned the frame.
* receiver -> sender: the receiver's loads of a buffer (its tensor's last reads, or its copy
  out) must be done before the sender can see the chunk's byte cleared and overwrite it. On
  x86-64 (TSO) a load is never reordered with a later store, and the last reads and the
  clearing store are separate C calls (the tensor's reads happened before its last reference
  was dropped), so no compiler reorders them either. Elsewhere a full fence goes between them
  (libatomic's ``atomic_thread_fence``); where none can be had, rings are not used. The
  sender's stores into a freed chunk depend on its load of the chunk's byte (it branches on
  it), so they cannot be made visible before that load.

Trust: the receiver maps the ring only if the file is sealed against shrinking (a truncated
file would make its reads fault), has the size its announced data size implies, and that size
is within bounds. It reads nothing from the header; it keeps its own record of the chunks its
lent tensors hold, and a frame naming a position off a chunk's start, past the ring's end, or
over a chunk still held is a protocol error that drops the connection -- so two received
tensors never share memory, whatever the sender writes. A lent tensor is memory the sender can
still write to (the peer is authenticated and on the same host; a receiver that must not see
its tensors change turns lending off). A ring belongs to one connection: it is dropped with it
(its memory lives on while tensors lent from it do), so nothing of a peer's old incarnation
reaches a new one.
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import mmap
import os
import platform
import socket
import ssl
import stat
import struct
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any

import numpy

from .. import _config
from .._config import ENV_SHM_RING, ENV_SHM_RING_LEND, env_flag
from .._errors import ProtocolError
from ._memory import peer_pid

__all__ = [
    "RingReader",
    "RingWriter",
    "available",
    "budget_used",
    "lent_bytes",
    "local_peer",
    "receive_fds",
]

#: bytes of data per chunk (a buffer takes whole chunks, from a chunk's start: page-aligned)
CHUNK = 4096
_CHUNK_SHIFT = 12
#: the sizes a receiver accepts for a ring (data bytes, whole chunks)
MIN_SIZE = 64 * 1024
MAX_SIZE = 1 << 30
#: buffers from this size are lent; smaller ones are copied out, which costs as much as lending
#: (a weak reference and its callback) there, and holds no ring space (measured, 2 processes,
#: echo round trip: 64 KiB 219-237 µs lent vs 222-224 copied, 128 KiB 232-244 vs 229-234,
#: 256 KiB 239-243 vs 247-251)
LEND_FROM = 256 * 1024
#: the offer frame's payload: the ring's data size
OFFER = struct.Struct("<Q")
#: room for the descriptors one read may bring (one is expected; more are closed)
_FD_SPACE = socket.CMSG_SPACE(4 * struct.calcsize("i")) if hasattr(socket, "CMSG_SPACE") else 0
_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


def _load_fence() -> tuple[bool, Callable[[], None] | None]:
    """Whether rings can be ordered on this machine, and the fence to use (None: not needed)."""
    if platform.machine().lower() in ("x86_64", "amd64"):
        return True, None  # TSO: loads are not reordered with later stores
    try:
        fence = ctypes.CDLL("libatomic.so.1").atomic_thread_fence
    except (OSError, AttributeError):
        return False, None
    fence.argtypes = [ctypes.c_int]
    fence.restype = None
    return True, lambda: fence(5)  # memory_order_seq_cst


_ORDERED, _fence = _load_fence()
_SUPPORTED = (
    sys.platform.startswith("linux")
    and _ORDERED
    and hasattr(os, "memfd_create")
    and hasattr(fcntl, "F_ADD_SEALS")
    and hasattr(socket, "SCM_RIGHTS")
    and _FD_SPACE > 0
)


def available() -> bool:
    """True where rings can be made and used (Linux with memfd and sealing, an ordering this
    module knows how to get, and not turned off by ``DISTGRAD_SHM_RING=0``)."""
    return _SUPPORTED and env_flag(ENV_SHM_RING, True)


def local_peer(sock: socket.socket) -> bool:
    """Whether a connection over ``sock`` takes part in the ring protocol: a plain Unix-domain
    socket to another process (the kernel names it). Each side then sends one ``RING_OFFER``,
    with a ring where :func:`available`, without one elsewhere."""
    if isinstance(sock, ssl.SSLSocket):
        return False
    if sock.family != getattr(socket, "AF_UNIX", None):
        return False
    return peer_pid(sock) is not None


def receive_fds(sock: socket.socket, buf: memoryview, fds: list[int], flags: int = 0) -> int:
    """``recv_into`` that also takes the descriptors passed with the bytes (``SCM_RIGHTS``) and
    appends them to ``fds`` (a plain ``recv_into`` would make the kernel close them)."""
    n, ancillary, _flags, _address = sock.recvmsg_into([buf], _FD_SPACE, flags)
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            count = len(data) // 4
            fds.extend(struct.unpack(f"{count}i", data[: 4 * count]))
    return n


_budget_lock = threading.Lock()
#: bytes of the rings this process's senders hold now (against ``SHM_RING_BUDGET``)
_budget_used = 0


def _reserve(size: int) -> None:
    """Count a new ring against the process's budget; ``ValueError`` when it is spent."""
    global _budget_used
    with _budget_lock:
        if _budget_used + size > _config.SHM_RING_BUDGET:
            raise ValueError(
                f"this process's rings hold {_budget_used} bytes already, and another of {size} "
                f"would pass {_config.ENV_SHM_RING_BUDGET}={_config.SHM_RING_BUDGET}"
            )
        _budget_used += size


def _give_back(size: int) -> None:
    global _budget_used
    with _budget_lock:
        _budget_used -= size


def budget_used() -> int:
    """Bytes of rings this process's senders hold now."""
    return _budget_used


#: bytes of ring chunks this process's received tensors hold now (lent by :class:`RingReader`)
_lent = 0
#: how many forks lie between the first process and this one: a reader frees chunks only in
#: the process that mapped it. A forked child shares the mapping and a copy of every lent
#: tensor, and dropping its copy must not free what the parent's tensor still uses (the
#: sender would write over it).
_forks = 0


def _forked() -> None:
    global _forks, _lent, _budget_lock
    _forks += 1
    _lent = 0
    _budget_lock = threading.Lock()  # (another thread of the parent may have held it)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked)

#: the weak references that free lent buffers, by ``id``: held here, not by their reader, so
#: that a reader dropped with its connection (and collected) still frees -- and counts -- what
#: its tensors held when they die (the reader and its mapping live as long as those tensors)
_lent_refs: dict[int, weakref.ref[Any]] = {}


def _count_lent(nbytes: int) -> None:
    global _lent
    with _budget_lock:
        _lent += nbytes


def lent_bytes() -> int:
    """Bytes of peers' rings that this process's received tensors hold now (whole chunks;
    they are freed as those tensors die, also after their connection closed)."""
    return _lent


def header_bytes(size: int) -> int:
    """Bytes of the header before ``size`` bytes of data: one per chunk, in whole pages."""
    return max(4096, -(-(size // CHUNK) // 4096) * 4096)


_ONES = b"\x01" * 4096


class RingWriter:
    """The sending side: makes the ring, places buffers in it. Each ring counts against the
    process's ``SHM_RING_BUDGET`` while it lives: past it, making one raises ``ValueError``
    (the connection then offers none)."""

    def __init__(self, size: int) -> None:
        if size < MIN_SIZE or size > MAX_SIZE or size % CHUNK:
            raise ValueError(
                f"a ring holds {MIN_SIZE}..{MAX_SIZE} bytes, whole {CHUNK}-byte chunks"
            )
        _reserve(size)
        try:
            fd = os.memfd_create("distgrad-ring", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        except BaseException:
            _give_back(size)
            raise
        header = header_bytes(size)
        try:
            os.ftruncate(fd, header + size)
            fcntl.fcntl(
                fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
            )
            self._map = mmap.mmap(fd, header + size)
        except BaseException:
            os.close(fd)
            _give_back(size)
            raise
        weakref.finalize(self, _give_back, size)  # (dropped with its connection)
        #: the memfd, to pass to the peer (then closed: the mapping keeps the memory)
        self.fd: int | None = fd
        self.size = size
        #: the largest buffer placed here (larger ones go the other ways)
        self.limit = size // 2
        self._header = header
        self._chunks = size // CHUNK
        # (views of the mapping keep it mapped while they live: the ring unmaps when dropped)
        self._view = memoryview(self._map)
        self._faulted = False

    def close_fd(self) -> None:
        """Close the memfd (after it was passed on, or when it will not be)."""
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)

    def place(self, view: memoryview) -> int:
        """Copy ``view`` (at most :attr:`limit` bytes) into the first run of free chunks that
        holds it and return its position; -1 when there is none (the buffer goes another way:
        a sender never waits for the receiver). Call under the connection's lock; the frame
        naming the position must follow (or :meth:`unplace` it)."""
        n = view.nbytes
        k = (n + CHUNK - 1) >> _CHUNK_SHIFT
        # (the receiver only ever clears bytes: a free chunk seen here stays free)
        at = self._map.find(bytes(k), 0, self._chunks)
        if at < 0:
            return -1
        if not self._faulted:
            self._fault_in()
        view_ = self._view
        start = self._header + (at << _CHUNK_SHIFT)
        view_[start : start + n] = view  # (a memcpy; cheaper than a foreign call here)
        view_[at : at + k] = _ONES[:k] if k <= 4096 else b"\x01" * k  # (only this side reads)
        return at << _CHUNK_SHIFT

    def unplace(self, position: int, n: int) -> None:
        """Free what :meth:`place` returned for a buffer whose frame was never written (the
        receiver does not know of it, so this side may clear its chunks)."""
        at = position >> _CHUNK_SHIFT
        k = (n + CHUNK - 1) >> _CHUNK_SHIFT
        self._view[at : at + k] = bytes(k)

    def chunks_in_use(self) -> int:
        """Chunks the receiver has not freed (its lent tensors', and those on their way)."""
        return self._chunks - self._map[: self._chunks].count(0)

    def _fault_in(self) -> None:
        """Fault the ring's pages in, once (fresh shmem pages are zeroed one fault at a time)."""
        self._faulted = True
        try:
            self._map.madvise(_MADV_POPULATE_WRITE, self._header, self.size)
        except (OSError, ValueError):  # kernels before 5.14: touch every page
            view = self._view
            for offset in range(self._header, self._header + self.size, 4096):
                view[offset] = 0


class RingReader:
    """The receiving side: maps the peer's ring, lends its buffers as received tensors' memory
    (or copies them out), frees their space."""

    def __init__(self, fd: int, announced: int, lend: bool | None = None) -> None:
        """Map the ring behind ``fd`` (the caller keeps and closes ``fd``); ``ProtocolError``
        when it is not one this side can safely read. ``lend``: whether :meth:`take` lends
        the ring's memory (default: unless ``DISTGRAD_SHM_RING_LEND=0``)."""
        if announced < MIN_SIZE or announced > MAX_SIZE or announced % CHUNK:
            raise ProtocolError(f"the ring offered has an unacceptable size {announced}")
        info = os.fstat(fd)
        header = header_bytes(announced)
        if not stat.S_ISREG(info.st_mode) or info.st_size != header + announced:
            raise ProtocolError(f"the ring offered does not have its announced size {announced}")
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        except OSError as exc:
            raise ProtocolError(f"the ring offered cannot be sealed: {exc}") from exc
        if not seals & fcntl.F_SEAL_SHRINK:
            raise ProtocolError("the ring offered is not sealed against shrinking")
        self._map = mmap.mmap(fd, header + announced)
        self.size = announced
        self.lend = env_flag(ENV_SHM_RING_LEND, True) if lend is None else lend
        self._header = header
        self._view = memoryview(self._map)
        #: this side's record of the chunks it holds (never read from the shared header)
        self._held = bytearray(announced // CHUNK)
        #: chunks lent now, and the most that may be: half the ring, so that tensors kept for
        #: long (a parameter server's, a replay buffer's) leave the other half to the traffic
        #: -- buffers past it are copied out and freed at once
        self._lent_chunks = 0
        self.lend_cap = announced // CHUNK // 2
        #: the smallest buffer lent (:data:`LEND_FROM`)
        self.lend_from = LEND_FROM
        self._lock = threading.Lock()
        self._mapped = False
        self._fork = _forks  # (the process that may free: see ``_forks``)

    def take(self, position: int, n: int) -> memoryview:
        """The ``n``-byte buffer at ``position``, as a writable byte view whose array (numpy's,
        so that a received tensor takes it as its storage) holds the buffer's chunks until it
        dies -- or, when not lending (a buffer under :attr:`lend_from`, or :attr:`lend_cap`
        chunks lent already), a copy, the chunks freed at once. ``ProtocolError`` when the
        frame's values do not name a buffer of this ring that lies over free chunks."""
        if n <= 0 or position < 0 or position & (CHUNK - 1) or position + n > self.size:
            raise ProtocolError(
                f"a ring reference ({n} bytes at {position}) lies outside the ring "
                f"({self.size} bytes of {CHUNK}-byte chunks)"
            )
        at = position >> _CHUNK_SHIFT
        end = (position + n + CHUNK - 1) >> _CHUNK_SHIFT
        held = self._held
        with self._lock:
            if held.find(1, at, end) >= 0:
                raise ProtocolError(
                    f"a ring reference ({n} bytes at {position}) overlaps a buffer still in use"
                )
            held[at:end] = _ONES[: end - at] if end - at <= 4096 else b"\x01" * (end - at)
            lend = (
                self.lend and n >= self.lend_from and self._lent_chunks + end - at <= self.lend_cap
            )
            if lend:
                self._lent_chunks += end - at
        if not self._mapped:
            self._mapped = True
            try:  # (the sender faulted the pages in: map them all at once)
                self._map.madvise(_MADV_POPULATE_READ, self._header, self.size)
            except (OSError, ValueError):
                pass
        start = self._header + position
        if lend:
            try:
                array = numpy.frombuffer(self._view[start : start + n], dtype=numpy.uint8)
                ref = weakref.ref(array, functools.partial(self._died, at, end))
            except BaseException:
                self._free(at, end, lent=True)
                raise
            _lent_refs[id(ref)] = ref
            _count_lent((end - at) << _CHUNK_SHIFT)
            return memoryview(array)  # type: ignore[arg-type]
        out = numpy.empty(n, dtype=numpy.uint8)
        copy = memoryview(out)  # type: ignore[arg-type]
        copy[:] = self._view[start : start + n]
        self._free(at, end)
        return copy

    def held(self) -> int:
        """Chunks this side holds now (those of the lent buffers alive)."""
        return len(self._held) - self._held.count(0)

    def _died(self, at: int, end: int, ref: object) -> None:
        _lent_refs.pop(id(ref), None)
        if self._fork != _forks:  # (a forked child's copy of the tensor: the parent's frees)
            return
        self._free(at, end, lent=True)
        _count_lent(-((end - at) << _CHUNK_SHIFT))

    def _free(self, at: int, end: int, lent: bool = False) -> None:
        if _fence is not None:
            _fence()  # the buffer's loads before the clearing store (see the module's docstring)
        zeros = bytes(end - at)
        with self._lock:
            self._view[at:end] = zeros
            self._held[at:end] = zeros
            if lent:
                self._lent_chunks -= end - at
