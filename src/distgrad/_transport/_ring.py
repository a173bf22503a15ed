"""A shared-memory ring per same-host connection direction: mid-size tensors copied once each way.

Through a Unix socket a tensor is copied twice (into the kernel by ``sendmsg``, out of it by
``recv_into``) with system calls and socket-buffer bookkeeping on both sides. Direct reads
(``_memory``) pay off from 4 MiB; below that one ``process_vm_readv`` per buffer and a
``RELEASE`` frame per message cost more than the socket's second copy. A fresh memfd per
message loses too (fresh shmem pages are zeroed and faulted in one by one). So the sender of
each same-host connection direction makes *one* memfd, passes it to the receiver over the Unix
socket (``SCM_RIGHTS``, after the authenticated handshake) and reuses it for the connection's
life: its pages are faulted in once, at the first message that uses it. A buffer then costs
one ``memmove`` into the ring on the sender and one out of it -- straight into the memory that
becomes the received tensor's storage -- on the receiver; the frame on the socket carries the
buffer's position instead of its bytes. No system call beyond the frame, no frame back: the
receiver frees the space by advancing a counter in the ring's header.

Layout: a 4 KiB header (the consumer's counter, a little-endian u64 at offset 0, written only
by the receiver), then ``size`` bytes of data. Positions are byte counts since the ring's
start (monotonic, u64); a buffer lies at ``position % size`` and never wraps: one that does not
fit before the end starts at the next lap (the gap counts as used until it is consumed).

Memory ordering, both directions:

* sender -> receiver: the sender copies the buffer into the ring *before* it writes the frame
  naming it; the receiver copies it out only *after* it read that frame. The socket write and
  read pair is the barrier: the kernel queues and dequeues the frame under the socket's lock
  (a release on the sending CPU, an acquire on the receiving one), so every store the sender
  made before ``sendmsg`` is visible to the receiver after its ``recv`` returned the frame.
* receiver -> sender: the receiver's loads (its copy out) must be done before the sender can
  see the advanced counter and overwrite that space. On x86-64 (TSO) a load is never
  reordered with a later store, and the copy and the counter's store are separate C calls,
  so no compiler reorders them either. Elsewhere a full fence goes between them (libatomic's
  ``atomic_thread_fence``); where none can be had, rings are not used. The sender's stores
  into freed space depend on its load of the counter (it branches on it), so they cannot be
  made visible before that load.

Trust: the receiver maps the ring only if the file is sealed against shrinking (a truncated
file would make its reads fault), has the announced size, and the size is within bounds; it
reads nothing from the header but its own counter, and checks every position and length a
frame names against the ring and against what it consumed already (a buffer must lie after the
last one, within one lap): anything else is a protocol error that drops the connection. The
sender in turn checks the counter the receiver writes (between what it consumed and what was
placed) and stops using a ring whose counter is impossible. A ring belongs to one connection:
it is dropped with it, so nothing of a peer's old incarnation reaches a new one.
"""

from __future__ import annotations

import ctypes
import fcntl
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

from .. import _config
from .._config import ENV_SHM_RING, env_flag
from .._errors import ProtocolError
from ._memory import peer_pid

__all__ = ["RingReader", "RingWriter", "available", "budget_used", "local_peer", "receive_fds"]

#: header bytes before the data (the consumer's counter at offset 0; page-aligned data)
HEADER_BYTES = 4096
#: buffers start at multiples of this (cache lines: whole-line copies)
ALIGN = 64
#: the sizes a receiver accepts for a ring (data bytes)
MIN_SIZE = 64 * 1024
MAX_SIZE = 1 << 30
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


class RingWriter:
    """The sending side: makes the ring, places buffers in it. Each ring counts against the
    process's ``SHM_RING_BUDGET`` while it lives: past it, making one raises ``ValueError``
    (the connection then offers none)."""

    def __init__(self, size: int) -> None:
        if size < MIN_SIZE or size > MAX_SIZE or size % ALIGN:
            raise ValueError(f"a ring holds {MIN_SIZE}..{MAX_SIZE} bytes, a multiple of {ALIGN}")
        _reserve(size)
        try:
            fd = os.memfd_create("distgrad-ring", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        except BaseException:
            _give_back(size)
            raise
        try:
            os.ftruncate(fd, HEADER_BYTES + size)
            fcntl.fcntl(
                fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
            )
            self._map = mmap.mmap(fd, HEADER_BYTES + size)
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
        # (views of the mapping keep it mapped while they live: the ring unmaps when dropped)
        self._view = memoryview(self._map)
        self._consumed = ctypes.c_uint64.from_buffer(self._map)
        self._head = 0  # where the next buffer may start
        self._tail = 0  # the consumer's counter as last read
        self._faulted = False

    def close_fd(self) -> None:
        """Close the memfd (after it was passed on, or when it will not be)."""
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)

    def place(self, view: memoryview) -> int:
        """Copy ``view`` into free space and return its position; -1 when there is no room
        (the buffer goes another way: a sender never waits for the receiver). Call under the
        connection's lock, in the order the frames naming the buffers are written. Raises
        ``ProtocolError`` when the receiver's counter is impossible."""
        n = view.nbytes
        size = self.size
        head = self._head
        tail = self._consumed.value
        if tail < self._tail or tail > head:
            raise ProtocolError(
                f"the peer's ring counter {tail} lies outside [{self._tail}, {head}]"
            )
        self._tail = tail
        start = head % size
        position = head if start + n <= size else head + (size - start)
        end = position + n
        if end - tail > size:
            return -1
        if not self._faulted:
            self._fault_in()
        start = HEADER_BYTES + position % size
        self._view[start : start + n] = view  # (a memcpy; cheaper than a foreign call here)
        self._head = (end + ALIGN - 1) & ~(ALIGN - 1)
        return position

    def _fault_in(self) -> None:
        """Fault the ring's pages in, once (fresh shmem pages are zeroed one fault at a time)."""
        self._faulted = True
        try:
            self._map.madvise(_MADV_POPULATE_WRITE, HEADER_BYTES, self.size)
        except (OSError, ValueError):  # kernels before 5.14: touch every page
            view = self._view
            for offset in range(HEADER_BYTES, HEADER_BYTES + self.size, 4096):
                view[offset] = 0


class RingReader:
    """The receiving side: maps the peer's ring, copies buffers out, frees their space."""

    def __init__(self, fd: int, announced: int) -> None:
        """Map the ring behind ``fd`` (the caller keeps and closes ``fd``); ``ProtocolError``
        when it is not one this side can safely read."""
        info = os.fstat(fd)
        size = info.st_size - HEADER_BYTES
        if not stat.S_ISREG(info.st_mode) or size != announced:
            raise ProtocolError(f"the ring offered does not have its announced size {announced}")
        if size < MIN_SIZE or size > MAX_SIZE or size % ALIGN:
            raise ProtocolError(f"the ring offered has an unacceptable size {size}")
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        except OSError as exc:
            raise ProtocolError(f"the ring offered cannot be sealed: {exc}") from exc
        if not seals & fcntl.F_SEAL_SHRINK:
            raise ProtocolError("the ring offered is not sealed against shrinking")
        self._map = mmap.mmap(fd, HEADER_BYTES + size)
        self.size = size
        self._view = memoryview(self._map)
        self._consumed = ctypes.c_uint64.from_buffer(self._map)
        self._tail = 0  # one past the last byte consumed
        self._mapped = False

    def take(self, position: int, into: memoryview) -> None:
        """Copy the buffer at ``position`` (``into.nbytes`` long) into ``into`` and free its
        space; ``ProtocolError`` when the frame's values do not name a buffer of this ring
        that follows the last one taken."""
        n = into.nbytes
        size = self.size
        tail = self._tail
        start = position % size
        if (
            n <= 0
            or position < tail
            or position - tail >= size
            or start + n > size
            or position + n - tail > size
        ):
            raise ProtocolError(
                f"a ring reference ({n} bytes at {position}) lies outside the ring "
                f"({size} bytes, {tail} consumed)"
            )
        if not self._mapped:
            self._mapped = True
            try:  # (the sender faulted the pages in: map them all at once)
                self._map.madvise(_MADV_POPULATE_READ, HEADER_BYTES, size)
            except (OSError, ValueError):
                pass
        start += HEADER_BYTES
        into[:] = self._view[start : start + n]
        self._tail = position + n
        if _fence is not None:
            _fence()  # the copy's loads before the counter's store (see the module's docstring)
        self._consumed.value = position + n
