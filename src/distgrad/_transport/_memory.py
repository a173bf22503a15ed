"""Direct memory reads between workers on one host (Linux cross-memory attach).

A large tensor sent over a Unix socket is copied twice: into the kernel by the sender's
``sendmsg``, out of it by the receiver's ``recv_into``. With ``process_vm_readv`` the receiver
copies it once, straight from the sender's memory into the buffer that becomes its tensor's
storage (measured on the 2-core dev machines, 16 MiB: 2.6 ms against 4.4 ms through the socket).
Shared memory (a memfd passed over the socket) was measured too and lost: fresh shmem pages are
zeroed and faulted in one by one (14.6 ms for 16 MiB, no transparent huge pages for shmem).

The kernel lets a process read another one's memory only where it could ptrace it (same user
and the target dumpable, or ``CAP_SYS_PTRACE``; Yama's ``ptrace_scope`` may forbid it between
siblings). So each side of a Unix-socket connection *offers*: it sends the address of a probe
holding random bytes; the peer reads the probe from the process the kernel names as the
socket's other end (``SO_PEERCRED``, never a pid from the wire) and accepts only when the bytes
match. Only then does the offering side send large buffers by reference. Anything the reads
could reach is memory of the process that offered it, which that process could send anyway.
"""

from __future__ import annotations

import ctypes
import os
import socket
import struct
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from .._config import ENV_CROSS_MEMORY, env_flag
from .._wire._frames import buffer_address

__all__ = ["MemoryProbe", "available", "peer_pid", "read_memory", "readable"]

_PROBE_BYTES = 16
_PROBE = struct.Struct(f"<Q{_PROBE_BYTES}s")


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _load_readv() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        func = libc.process_vm_readv
    except (OSError, AttributeError):
        return None
    func.restype = ctypes.c_ssize_t
    func.argtypes = [
        ctypes.c_int,
        ctypes.POINTER(_IoVec),
        ctypes.c_ulong,
        ctypes.POINTER(_IoVec),
        ctypes.c_ulong,
        ctypes.c_ulong,
    ]
    return func  # type: ignore[no-any-return]


_readv = _load_readv()


def available() -> bool:
    """True where direct reads can be tried (Linux, and not turned off by the environment)."""
    return _readv is not None and env_flag(ENV_CROSS_MEMORY, True)


def peer_pid(sock: socket.socket) -> int | None:
    """The pid of the process at the other end of a Unix-domain socket, as the kernel sees it."""
    if sock.family != getattr(socket, "AF_UNIX", None) or not hasattr(socket, "SO_PEERCRED"):
        return None
    try:
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except OSError:
        return None
    pid = struct.unpack("3i", creds)[0]
    return pid if pid > 0 and pid != os.getpid() else None


def read_memory(pid: int, address: int, into: memoryview) -> None:
    """Copy ``into.nbytes`` bytes at ``address`` in process ``pid`` into ``into``.

    A large range is copied by two threads, half each: one thread does not reach the memory
    bandwidth (16 MiB on the 2-core dev machines: 2.1 ms with two threads, 3.0 ms with one).
    Raises ``OSError`` when the kernel refuses or the range is not mapped in that process.
    """
    if _readv is None:
        raise OSError("direct memory reads are not supported on this platform")
    total = into.nbytes
    local_base = buffer_address(into)
    if total >= _PARALLEL_THRESHOLD and _CPUS > 1:
        half = (total // 2) & ~4095
        helper = _helper().submit(_read_range, pid, address + half, local_base + half, total - half)
        try:
            _read_range(pid, address, local_base, half)
        finally:
            helper.result()  # re-raises the helper's error, if any
        return
    _read_range(pid, address, local_base, total)


def readable(view: memoryview) -> bool:
    """Whether the kernel lets ``process_vm_readv`` read the memory behind ``view`` (tried on
    this process itself, a byte every :data:`_PROBE_STRIDE` and the last one: one system call).

    Memory that a driver maps for I/O -- CUDA's pinned host memory with some NVIDIA drivers, a
    device's registers -- can be read by the process that maps it but not through the
    kernel's cross-memory path (``EFAULT``): such a buffer must travel through the socket.
    The handshake's probe tests ordinary heap memory only, so the sender asks again for the
    memory it is about to send by reference (issue 29, item 1)."""
    if _readv is None or view.nbytes == 0:
        return False
    base = buffer_address(view)
    offsets = list(range(0, view.nbytes, _PROBE_STRIDE))[:_PROBE_POINTS]
    offsets.append(view.nbytes - 1)
    count = len(offsets)
    scratch = ctypes.create_string_buffer(count)
    local = (_IoVec * count)(*(_IoVec(ctypes.addressof(scratch) + i, 1) for i in range(count)))
    remote = (_IoVec * count)(*(_IoVec(base + offset, 1) for offset in offsets))
    return bool(_readv(os.getpid(), local, count, remote, count, 0) == count)


_PROBE_STRIDE = 16 * 1024 * 1024
_PROBE_POINTS = 63
_PARALLEL_THRESHOLD = 8 * 1024 * 1024
_CPUS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
_copier: ThreadPoolExecutor | None = None
_copier_lock = threading.Lock()


def _helper() -> ThreadPoolExecutor:
    global _copier
    if _copier is None:
        with _copier_lock:
            if _copier is None:
                _copier = ThreadPoolExecutor(1, thread_name_prefix="distgrad-copy")
    return _copier


def _read_range(pid: int, address: int, local_base: int, total: int) -> None:
    readv = _readv
    assert readv is not None
    done = 0
    while done < total:
        local = _IoVec(local_base + done, total - done)
        remote = _IoVec(address + done, total - done)
        n = readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        if n < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"reading process {pid}'s memory failed: {os.strerror(err)}")
        if n == 0:
            raise OSError(f"reading process {pid}'s memory stopped at byte {done} of {total}")
        done += n


class MemoryProbe:
    """Random bytes at a known address, offered to a peer to test whether it can read us."""

    def __init__(self) -> None:
        self._buffer = ctypes.create_string_buffer(os.urandom(_PROBE_BYTES), _PROBE_BYTES)

    def offer(self) -> bytes:
        """The offer's payload: the probe's address and the bytes the peer must find there."""
        return _PROBE.pack(ctypes.addressof(self._buffer), self._buffer.raw)

    @staticmethod
    def check(pid: int, offer: bytes | bytearray) -> bool:
        """Whether this process can read what ``offer`` says is in process ``pid``."""
        if len(offer) != _PROBE.size:
            return False
        address, expected = _PROBE.unpack(offer)
        found = bytearray(_PROBE_BYTES)
        try:
            read_memory(pid, address, memoryview(found))
        except OSError:
            return False
        return bool(bytes(found) == expected)
