"""Unit tests of direct memory reads (``distgrad._transport._memory``) within this process."""

from __future__ import annotations

import ctypes
import mmap
import os
import socket
import time

import pytest

from distgrad._transport import _memory
from distgrad._wire._frames import buffer_address
from tests._needs import needs

pytestmark = needs(None if _memory.available() else "needs Linux process_vm_readv")


def test_read_memory_copies_a_range_of_the_process() -> None:
    source = bytearray(os.urandom(1 << 20))
    into = bytearray(len(source))
    _memory.read_memory(os.getpid(), buffer_address(memoryview(source)), memoryview(into))
    assert into == source


def test_read_memory_of_an_unmapped_range_raises_oserror() -> None:
    with pytest.raises(OSError, match="memory"):
        _memory.read_memory(os.getpid(), 4096, memoryview(bytearray(64)))


def test_probe_is_accepted_only_when_its_bytes_are_found() -> None:
    """An offer is accepted when the reader finds the offered bytes at the offered address; a
    wrong address, wrong bytes or a truncated offer is refused (the reader falls back)."""
    probe = _memory.MemoryProbe()
    offer = probe.offer()
    assert _memory.MemoryProbe.check(os.getpid(), offer)
    tampered = offer[:-1] + bytes([offer[-1] ^ 1])
    assert not _memory.MemoryProbe.check(os.getpid(), tampered)
    assert not _memory.MemoryProbe.check(os.getpid(), (4096).to_bytes(8, "little") + offer[8:])
    assert not _memory.MemoryProbe.check(os.getpid(), offer[:10])


def test_peer_pid_comes_from_the_kernel_and_only_for_unix_sockets() -> None:
    """A socketpair's other end is this very process: no peer to read (``None``); TCP sockets
    never name a peer process."""
    a, b = socket.socketpair()
    tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        assert _memory.peer_pid(a) is None  # our own pid is not a peer
        assert _memory.peer_pid(tcp) is None
    finally:
        a.close()
        b.close()
        tcp.close()


def test_environment_turns_reads_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DISTGRAD_CROSS_MEMORY", "0")
    assert not _memory.available()


def test_large_reads_are_split_between_two_threads_and_exact() -> None:
    """Ranges from 8 MiB are copied in two halves by two threads; odd sizes come out whole."""
    source = bytearray(os.urandom(9 * 1024 * 1024 + 12345))
    into = bytearray(len(source))
    _memory.read_memory(os.getpid(), buffer_address(memoryview(source)), memoryview(into))
    assert into == source


def test_a_failure_in_either_half_of_a_split_read_raises() -> None:
    """The helper thread's half fails (its pages are not readable): the read raises."""
    size = 16 * 1024 * 1024
    region = mmap.mmap(-1, size)
    address = buffer_address(memoryview(region))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    assert libc.mprotect(address + size // 2, size // 2, 0) == 0  # PROT_NONE
    with pytest.raises(OSError, match="memory"):
        _memory.read_memory(os.getpid(), address, memoryview(bytearray(size)))
    assert libc.mprotect(address + size // 2, size // 2, mmap.PROT_READ | mmap.PROT_WRITE) == 0
    region.close()


def test_a_sender_that_died_is_a_peer_failure_not_a_protocol_error() -> None:
    """A by-reference read from a process that is gone (ESRCH) fails as the peer's death, so
    the transport condemns the peer (and fails what waits on it) instead of treating it as a
    bad frame."""
    from distgrad._errors import PeerFailureError
    from distgrad._transport._connection import Connection
    from distgrad._transport._io import IoThread

    child = os.fork()
    if child == 0:
        os._exit(0)
    while _state(child) != "Z":
        time.sleep(0.01)  # a zombie: no memory any more, and its pid cannot be reused yet
    a, b = socket.socketpair()
    io = IoThread()
    try:
        conn = Connection(None, io, a, 1, "worker w1 (rank 1)", 1 << 30)  # type: ignore[arg-type]
        conn._peer_pid, conn._read_peer = child, True
        source = bytearray(64)
        with pytest.raises(PeerFailureError, match="died before its message was read"):
            conn._read_remote(buffer_address(memoryview(source)), memoryview(bytearray(64)))
    finally:
        a.close()
        b.close()
        io.loop.close()
        os.waitpid(child, 0)


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def test_readable_tells_memory_the_kernel_can_read_from_memory_it_cannot() -> None:
    """The sender's probe of the memory it is about to send by reference: ordinary memory is
    readable; a range whose first page, or only its last page, the kernel refuses (here
    ``PROT_NONE``; pinned CUDA memory that a driver maps for I/O fails the same way, EFAULT)
    is not, so the buffer goes through the socket instead of failing the receiver's read."""
    assert _memory.readable(memoryview(bytearray(os.urandom(5 << 20))))
    assert not _memory.readable(memoryview(bytearray()))
    size = 32 * 1024 * 1024
    region = mmap.mmap(-1, size)
    view = memoryview(region)
    address = buffer_address(view)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    rw = mmap.PROT_READ | mmap.PROT_WRITE
    try:
        assert _memory.readable(view)
        for start, length in ((0, 4096), (size - 4096, 4096), (size // 2, 4096)):
            assert libc.mprotect(address + start, length, 0) == 0  # PROT_NONE
            assert not _memory.readable(view), (start, length)
            assert libc.mprotect(address + start, length, rw) == 0
        assert _memory.readable(view)
    finally:
        view.release()
        region.close()
