"""Unit tests of the shared-memory ring (``distgrad._transport._ring``) and of connections that
use it, over real Unix socket pairs in this process: the memfd passed with ``SCM_RIGHTS``,
buffers placed and taken bit-exact across the ring's end, a full ring sending inline, bounds
and offers a receiver must refuse (each drops the connection with a clear error), and a
closed connection's ring dropped with it."""

from __future__ import annotations

import ctypes
import fcntl
import gc
import os
import pickle
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest
import torch

from distgrad._errors import ProtocolError
from distgrad._transport import _connection, _ring
from distgrad._transport._connection import Connection
from distgrad._transport._io import IoThread
from distgrad._wire import _frames
from distgrad._wire._frames import (
    FLAG_IN_RING,
    HEADER,
    Frame,
    Kind,
    encode_frame,
    encode_frame_placed,
)
from tests._needs import needs
from tests.unit.test_frames import feed

pytestmark = needs(None if _ring.available() else "needs Linux memfd with sealing")

SIZE = 256 * 1024


def pattern(n: int, seed: int) -> bytearray:
    """``n`` bytes that differ from any other (n, seed)'s."""
    block = (seed.to_bytes(4, "little") + n.to_bytes(4, "little")) * 8 + os.urandom(64)
    return bytearray((block * (n // len(block) + 1))[:n])


def passed(writer: _ring.RingWriter) -> _ring.RingReader:
    """The reader's side of ``writer``, its memfd passed over a real Unix socket pair; it lends
    buffers of any size (by default only from ``LEND_FROM``)."""
    a, b = socket.socketpair()
    try:
        assert writer.fd is not None
        a.sendmsg([b"x"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("i", writer.fd))])
        fds: list[int] = []
        assert _ring.receive_fds(b, memoryview(bytearray(8)), fds) == 1
        assert len(fds) == 1 and fds[0] != writer.fd
        try:
            reader = _ring.RingReader(fds[0], writer.size)
            reader.lend_from = 1  # (this file's buffers are small: lend them all)
            return reader
        finally:
            os.close(fds[0])
    finally:
        writer.close_fd()
        a.close()
        b.close()


def take(reader: _ring.RingReader, position: int, n: int) -> bytearray:
    """A copy of what ``reader`` hands out (a lent buffer is freed when its array dies)."""
    return bytearray(reader.take(position, n))


def test_buffers_go_through_bit_exact_at_chunk_starts_and_their_space_is_placed_again() -> None:
    """Buffers of any size up to the limit come out as they went in, each at a chunk's start
    and never past the ring's end; the chunks of a buffer whose view died are placed again."""
    writer = _ring.RingWriter(SIZE)
    reader = passed(writer)
    sizes = [100_000, 100_000, 90_000, 128 * 1024, 1, 64 * 1024, 77_777, 128 * 1024] * 5
    positions = set()
    for i, n in enumerate(sizes):
        data = pattern(n, i)
        position = writer.place(memoryview(data))
        assert position >= 0, f"buffer {i} found no room in an empty ring"
        assert position % _ring.CHUNK == 0
        assert position + n <= SIZE
        positions.add(position)
        assert take(reader, position, n) == data
        assert reader.held() == writer.chunks_in_use() == 0  # (its view is gone)
    assert positions == {0}  # first fit: the freed chunks at the start, each time


def test_a_lent_buffer_is_the_tensors_memory_and_is_freed_when_the_tensor_dies() -> None:
    """A lent buffer is the received tensor's storage (no copy); its chunks stay in use --
    never overwritten -- while any view of that tensor lives, in whatever order the tensors
    die, and the sender fills what they free while others are still held."""
    writer = _ring.RingWriter(SIZE)
    reader = passed(writer)
    assert reader.lend
    reader.lend_cap = SIZE // _ring.CHUNK  # (lend all of it here; the cap has its own test)
    datas = [pattern(64 * 1024, i) for i in range(3)]
    tensors = []
    for data in datas:
        buf = reader.take(writer.place(memoryview(data)), len(data))
        tensors.append(torch.frombuffer(buf, dtype=torch.uint8))
        del buf
    assert reader.held() == writer.chunks_in_use() == 3 * 16
    at = ctypes.c_char.from_buffer(reader._view, reader._header + 64 * 1024)  # (its mapping)
    assert tensors[1].data_ptr() == ctypes.addressof(at)
    del at
    keep = tensors[1][10:20]  # a view keeps the storage
    del tensors[1]
    assert reader.held() == 48
    second = pattern(SIZE // 2, 7)  # no room before the end while the three are held
    assert writer.place(memoryview(second)) == -1
    del keep
    assert reader.held() == 32
    third = pattern(64 * 1024, 8)
    p3 = writer.place(memoryview(third))
    assert p3 == 64 * 1024  # the freed hole, between two held buffers
    assert bytes(tensors[0].numpy()) == bytes(datas[0])  # the held ones were not touched
    assert bytes(tensors[1].numpy()) == bytes(datas[2])
    assert take(reader, p3, len(third)) == third
    del tensors
    gc.collect()
    assert reader.held() == writer.chunks_in_use() == 0


def test_at_most_half_the_ring_is_lent_and_past_it_buffers_are_copied() -> None:
    """Tensors kept for long hold at most half the ring (``lend_cap``): a buffer that would
    pass it is copied out and its chunks freed at once, so the other half always carries the
    traffic; once a lent tensor dies, lending resumes."""
    writer = _ring.RingWriter(SIZE)
    reader = passed(writer)
    assert reader.lend_cap == SIZE // _ring.CHUNK // 2
    sent = [pattern(SIZE // 4, i) for i in (0, 1)]
    kept = [reader.take(writer.place(memoryview(data)), len(data)) for data in sent]
    assert reader.held() == reader.lend_cap  # half the ring lent
    for i in range(8):  # the traffic goes on through the other half, copied out
        data = pattern(SIZE // 4, 10 + i)
        position = writer.place(memoryview(data))
        assert position >= SIZE // 2
        copy = reader.take(position, len(data))
        assert bytes(copy) == bytes(data) and reader.held() == reader.lend_cap
    assert [bytes(k) for k in kept] == [bytes(data) for data in sent]
    del kept[0]
    data = pattern(SIZE // 4, 99)
    lent = reader.take(writer.place(memoryview(data)), len(data))
    assert reader.held() == reader.lend_cap and bytes(lent) == bytes(data)


def test_buffers_under_the_lending_size_are_copied() -> None:
    """By default a buffer under ``LEND_FROM`` is copied out and its chunks freed at once (a
    copy costs as much as lending there); one of that size is lent."""
    writer = _ring.RingWriter(4 * _ring.LEND_FROM)
    reader = passed(writer)
    reader.lend_from = _ring.LEND_FROM
    small, large = pattern(_ring.LEND_FROM - 1, 1), pattern(_ring.LEND_FROM, 2)
    copy = reader.take(writer.place(memoryview(small)), len(small))
    assert reader.held() == 0 and bytes(copy) == bytes(small)
    lent = reader.take(writer.place(memoryview(large)), len(large))
    assert reader.held() == _ring.LEND_FROM // _ring.CHUNK and bytes(lent) == bytes(large)
    del lent
    assert reader.held() == 0


def test_a_forked_child_dropping_a_lent_tensor_does_not_free_it() -> None:
    """A child forked while a tensor is lent shares the ring's mapping and has a copy of the
    tensor: when the child drops its copy, the chunks stay in use -- the parent's tensor still
    lives there and the sender must not write over it."""
    writer = _ring.RingWriter(SIZE)
    reader = passed(writer)
    data = pattern(100_000, 1)
    tensor = torch.frombuffer(
        reader.take(writer.place(memoryview(data)), len(data)), dtype=torch.uint8
    )
    pid = os.fork()
    if pid == 0:  # the child: drop its copy of the tensor, then leave without clean-up
        try:
            refs = len(_ring._lent_refs)
            del tensor
            fired = len(_ring._lent_refs) == refs - 1  # (its weak reference's callback ran)
            os._exit(0 if fired and reader.held() == 25 and _ring.lent_bytes() == 0 else 1)
        finally:
            os._exit(2)
    assert _exit_code(pid, "the forked child did not finish") == 0
    assert writer.chunks_in_use() == reader.held() == 25  # (still the parent's)
    assert writer.place(memoryview(pattern(SIZE - 100_000, 2))) == -1
    assert bytes(tensor.numpy()) == bytes(data)
    del tensor
    assert writer.chunks_in_use() == reader.held() == 0


def _exit_code(pid: int, stuck: str) -> int:
    """Wait at most 30 s for forked child ``pid``; its exit code (killed, and the test failed
    with ``stuck``, past the wait)."""
    deadline = time.monotonic() + 30
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    if done[0] == 0:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail(stuck)
    return os.waitstatus_to_exitcode(done[1])


def test_a_child_forked_while_the_ring_lock_is_held_can_still_count() -> None:
    """The process-wide lock of the ring counters is made anew in a forked child: one held by
    a thread of the parent at the fork would otherwise never be released there."""
    with _ring._budget_lock:  # (held, as by another thread, when the fork happens)
        pid = os.fork()
        if pid == 0:
            try:
                _ring._count_lent(4096)  # (would block forever on the copied, held lock)
                os._exit(0 if _ring.lent_bytes() == 4096 else 1)
            finally:
                os._exit(2)
    assert _exit_code(pid, "the forked child blocked on the ring counters' lock") == 0


def test_a_receiver_that_does_not_lend_copies_and_frees_at_once() -> None:
    """With lending off (``DISTGRAD_SHM_RING_LEND=0``), a buffer is copied out and its space
    freed before it is handed out: what the sender writes there next does not change it."""
    writer = _ring.RingWriter(SIZE)
    reader = passed(writer)
    reader.lend = False
    data = pattern(70_000, 1)
    buf = reader.take(writer.place(memoryview(data)), len(data))
    assert reader.held() == writer.chunks_in_use() == 0
    assert writer.place(memoryview(pattern(70_000, 2))) == 0  # (over the same chunks)
    assert bytes(buf) == bytes(data) and not buf.readonly


def test_the_environment_makes_receivers_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    writer = _ring.RingWriter(SIZE)
    monkeypatch.setenv("DISTGRAD_SHM_RING_LEND", "0")
    assert not passed(writer).lend


def test_a_full_ring_refuses_until_the_receiver_frees() -> None:
    """With the receiver's tensors alive, the sender gets -1 (it sends inline: it never
    waits); once one died, its space is free again."""
    writer = _ring.RingWriter(SIZE)
    reader = passed(writer)
    reader.lend_cap = SIZE // _ring.CHUNK  # (lend all of it)
    first, second = pattern(SIZE // 2, 1), pattern(SIZE // 2, 2)
    p1 = writer.place(memoryview(first))
    p2 = writer.place(memoryview(second))
    assert p1 >= 0 and p2 >= 0
    assert writer.place(memoryview(pattern(64, 3))) == -1
    held = reader.take(p1, len(first)), reader.take(p2, len(second))
    assert writer.place(memoryview(pattern(64, 3))) == -1
    assert bytes(held[1]) == second
    held = held[:1]
    third = pattern(SIZE // 4, 4)
    p3 = writer.place(memoryview(third))
    assert p3 == p2
    assert bytes(held[0]) == first and take(reader, p3, len(third)) == third


def test_a_buffer_whose_frame_was_not_written_is_unplaced() -> None:
    writer = _ring.RingWriter(SIZE)
    position = writer.place(memoryview(pattern(100_000, 1)))
    assert writer.chunks_in_use() == 25
    writer.unplace(position, 100_000)
    assert writer.chunks_in_use() == 0
    writer.close_fd()


def test_rings_count_against_the_process_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """A process makes rings while they add up to at most ``SHM_RING_BUDGET``; past it making
    one fails (its connection offers none), and a ring dropped with its connection gives its
    bytes back."""
    import gc

    from distgrad import _config

    size = _ring.MIN_SIZE
    before = _ring.budget_used()
    monkeypatch.setattr(_config, "SHM_RING_BUDGET", before + 2 * size)
    first, second = _ring.RingWriter(size), _ring.RingWriter(size)
    assert _ring.budget_used() == before + 2 * size
    with pytest.raises(ValueError, match="DISTGRAD_SHM_RING_BUDGET"):
        _ring.RingWriter(size)
    assert _ring.budget_used() == before + 2 * size  # (a refused ring takes nothing)
    for writer in (first, second):
        writer.close_fd()
    del first, writer
    gc.collect()
    assert _ring.budget_used() == before + size
    third = _ring.RingWriter(size)  # room again
    assert _ring.budget_used() == before + 2 * size
    second.close_fd()
    third.close_fd()


@pytest.mark.parametrize(
    "position, n, why",
    [
        (SIZE - 4096, 8192, "crosses the end"),
        (0, SIZE + 64, "longer than the ring"),
        (0, 0, "empty"),
        (SIZE * 3, 64, "past the end"),
        (100, 64, "off a chunk's start"),
        (-4096, 64, "negative"),
    ],
)
def test_a_reference_outside_the_ring_is_a_protocol_error(position: int, n: int, why: str) -> None:
    writer = _ring.RingWriter(SIZE)
    reader = passed(writer)
    with pytest.raises(ProtocolError, match="outside the ring"):
        reader.take(position, n)
    assert reader.held() == 0


def test_a_reference_over_a_buffer_still_in_use_is_a_protocol_error() -> None:
    """A frame naming chunks a lent tensor still holds (a replay, or a sender reusing space it
    was not given back) is refused: two received tensors never share memory."""
    writer = _ring.RingWriter(SIZE)
    reader = passed(writer)
    data = pattern(10_000, 0)
    position = writer.place(memoryview(data))
    held = reader.take(position, 10_000)
    for at, n in ((position, 10_000), (position + 4096, 100), (0, 3 * 4096)):
        with pytest.raises(ProtocolError, match="still in use"):
            reader.take(at, n)
    assert bytes(held) == data and reader.held() == 3
    del held
    assert take(reader, position, 10_000) == data  # (freed: the chunks may be named again)


def test_a_sender_takes_only_chunks_the_header_shows_free() -> None:
    """The sender reads the chunks' bytes and nothing else: any byte but 0 (garbage from the
    receiver included) keeps it off that chunk; it never overwrites one in use."""
    writer = _ring.RingWriter(SIZE)
    reader = passed(writer)
    reader._view[0 : SIZE // 4096 : 2] = b"\x07" * (SIZE // 8192)  # every other chunk
    assert writer.place(memoryview(pattern(8192, 1))) == -1  # (two chunks: no run of two)
    position = writer.place(memoryview(pattern(4096, 2)))
    assert position == 4096


def test_a_receiver_refuses_a_ring_it_cannot_safely_map() -> None:
    """Not sealed against shrinking (the sender could truncate it under the reader), another
    size than announced, or too small: refused before anything is mapped."""
    fd = os.memfd_create("unsealed", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, _ring.header_bytes(SIZE) + SIZE)
        with pytest.raises(ProtocolError, match="sealed"):
            _ring.RingReader(fd, SIZE)
    finally:
        os.close(fd)
    writer = _ring.RingWriter(SIZE)
    assert writer.fd is not None
    with pytest.raises(ProtocolError, match="announced size"):
        _ring.RingReader(writer.fd, SIZE * 2)
    writer.close_fd()
    fd = os.memfd_create("small", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, _ring.header_bytes(4096) + 4096)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
        with pytest.raises(ProtocolError, match="unacceptable size"):
            _ring.RingReader(fd, 4096)
    finally:
        os.close(fd)


def test_the_environment_turns_rings_off(monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = socket.socketpair()
    try:
        assert not _ring.local_peer(a)  # our own process at the other end
        monkeypatch.setenv("DISTGRAD_SHM_RING", "0")
        assert not _ring.available()
    finally:
        a.close()
        b.close()


# -- connections ---------------------------------------------------------------------------------
@dataclass
class Owner:
    """Records frames; ``hold`` (when set) blocks the reading thread at the first frame until
    released, so that the sender gets ahead of the receiver."""

    frames: list[Frame] = field(default_factory=list)
    got: threading.Condition = field(default_factory=threading.Condition)
    closed: threading.Event = field(default_factory=threading.Event)
    error: Exception | None = None
    hold: threading.Event | None = None

    def on_frame(self, conn: Connection, frame: Frame) -> None:
        if self.hold is not None:
            self.hold.wait(10)
            self.hold = None
        with self.got:
            self.frames.append(frame)
            self.got.notify_all()

    def on_closed(self, conn: Connection, error: Exception | None) -> None:
        self.error = error
        self.closed.set()

    def wait_for(self, count: int) -> list[Frame]:
        with self.got:
            assert self.got.wait_for(lambda: len(self.frames) >= count, 10), self.frames
            return list(self.frames)


@dataclass
class Side:
    conn: Connection
    owner: Owner
    io: IoThread


def _wait(predicate: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.005)
    return False


@pytest.fixture
def rings_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rings between two connections of this process (normally only to another process)."""
    monkeypatch.setattr(_ring, "local_peer", lambda sock: sock.family == socket.AF_UNIX)
    monkeypatch.setattr(_connection, "SHM_RING_SIZE", SIZE)


def _connect(sock: socket.socket, peer: int, *, start: bool = True) -> Side:
    sock.setblocking(False)
    io = IoThread(name=f"test-io-{peer}")
    io.start()
    owner = Owner()
    conn = Connection(owner, io, sock, peer, f"worker w{peer} (rank {peer})", 1 << 30)
    if start:
        io.call_soon(conn.start)
    return Side(conn, owner, io)


@pytest.fixture
def pair(rings_here: None) -> Iterator[tuple[Side, Side]]:
    a, b = socket.socketpair()
    left, right = _connect(a, 1), _connect(b, 0)
    try:
        yield left, right
    finally:
        for side in (left, right):
            side.conn.close()
            side.io.stop()
        a.close()
        b.close()


def _send(side: Side, data: list[bytearray], message_id: int) -> None:
    side.conn.send_frame(Kind.REQUEST, message_id, b"meta", [pickle.PickleBuffer(d) for d in data])


def test_connections_pass_rings_both_ways_and_buffers_arrive_bit_exact(
    pair: tuple[Side, Side],
) -> None:
    """Each side maps the other's ring; buffers from the threshold up to half the ring go
    through it (counted), smaller and larger ones inline, mixed in one frame, all exact."""
    left, right = pair
    assert _wait(lambda: left.conn._ring_out is not None and right.conn._ring_out is not None)
    sizes = [64 * 1024, 100, 100_000, SIZE // 2 + 1, 70_000]
    data = [pattern(n, i) for i, n in enumerate(sizes)]
    _send(left, data, 7)
    _send(right, data[::-1], 8)
    (got,) = right.owner.wait_for(1)
    assert got.message_id == 7 and got.meta == b"meta"
    assert [bytes(b) for b in got.buffers] == [bytes(d) for d in data]
    assert not got.flags & FLAG_IN_RING  # (the transport's flag is not the decoder's)
    (back,) = left.owner.wait_for(1)
    assert [bytes(b) for b in back.buffers] == [bytes(d) for d in data[::-1]]
    through = 64 * 1024 + 100_000 + 70_000
    assert right.conn.bytes_through_ring == through
    assert left.conn.bytes_through_ring == through


def test_a_frame_that_cannot_be_encoded_gives_back_what_it_placed(
    pair: tuple[Side, Side], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Buffers are placed before their frame is encoded; when encoding fails, their chunks are
    freed again (the peer never heard of them) and the error reaches the caller."""
    left, right = pair
    assert _wait(lambda: left.conn._ring_out is not None)

    def refuse(*args: object) -> list[bytes]:
        raise ValueError("frame too large (test)")

    real = _connection.encode_frame_placed
    monkeypatch.setattr(_connection, "encode_frame_placed", refuse)
    with pytest.raises(ValueError, match="too large"):
        _send(left, [pattern(100_000, 1), pattern(70_000, 2)], 1)
    ring = left.conn._ring_out
    assert ring is not None and ring.chunks_in_use() == 0
    monkeypatch.setattr(_connection, "encode_frame_placed", real)
    data = pattern(100_000, 3)
    _send(left, [data], 2)
    (got,) = right.owner.wait_for(1)
    assert bytes(got.buffers[0]) == bytes(data) and not right.owner.closed.is_set()


def test_a_full_ring_sends_inline_and_order_is_kept(pair: tuple[Side, Side]) -> None:
    """The receiver stalls at the first frame (it holds the ring's space): the sender does not
    wait -- what does not fit goes inline -- and every frame arrives, in order, exact."""
    left, right = pair
    assert _wait(lambda: left.conn._ring_out is not None)
    right.owner.hold = hold = threading.Event()
    messages = [[pattern(100_000, i)] for i in range(12)]
    for i, data in enumerate(messages):
        _send(left, data, i)  # never blocks on the ring
    hold.set()
    frames = right.owner.wait_for(len(messages))
    assert [f.message_id for f in frames] == list(range(len(messages)))
    for frame, data in zip(frames, messages, strict=True):
        assert bytes(frame.buffers[0]) == bytes(data[0])
    through = right.conn.bytes_through_ring
    assert 0 < through < 100_000 * len(messages)  # some went inline


def test_a_closed_connection_drops_its_rings(pair: tuple[Side, Side]) -> None:
    """Both sides drop their rings with the connection; a tensor lent from one lives on (its
    memory stays mapped, intact) and dies later without harm."""
    left, right = pair
    assert _wait(lambda: left.conn._ring_out is not None and right.conn._ring_out is not None)
    reader = right.conn._parser.read_ring
    assert isinstance(reader, _ring.RingReader)
    reader.lend_from = 1  # (this ring is small)
    data = pattern(100_000, 5)
    _send(left, [data], 1)
    (got,) = right.owner.wait_for(1)
    gc.collect()  # (what other tests left lent dies now, not in the middle of this one)
    lent = _ring.lent_bytes()
    assert lent >= 25 * _ring.CHUNK
    tensor = torch.frombuffer(got.buffers[0], dtype=torch.uint8)
    right.owner.frames.clear()
    del got
    left.conn.close()
    assert left.owner.closed.wait(5)
    assert left.conn._ring_out is None and left.conn._parser.read_ring is None
    assert right.owner.closed.wait(5)  # the peer's EOF
    assert right.conn._parser.read_ring is None
    del reader
    gc.collect()  # (the reader is gone but for what its tensor needs)
    assert bytes(tensor.numpy()) == bytes(data) and _ring.lent_bytes() == lent
    del tensor
    assert _ring.lent_bytes() == lent - 25 * _ring.CHUNK


def test_a_side_with_rings_off_says_so_and_buffers_go_inline(
    rings_here: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DISTGRAD_SHM_RING=0 on one side: it offers no ring and maps none (the other side's
    offer is left unanswered), the other side stops taking descriptors at its empty offer, and
    everything goes through the socket, exact."""
    a, b = socket.socketpair()
    monkeypatch.setenv("DISTGRAD_SHM_RING", "0")
    left = _connect(a, 1)
    monkeypatch.delenv("DISTGRAD_SHM_RING")
    right = _connect(b, 0)
    try:
        assert not left.conn._ring_pending
        assert _wait(lambda: not right.conn._ring_pending)
        data = [pattern(100_000, 1)]
        _send(left, data, 1)
        _send(right, data, 2)
        assert bytes(right.owner.wait_for(1)[0].buffers[0]) == bytes(data[0])
        assert bytes(left.owner.wait_for(1)[0].buffers[0]) == bytes(data[0])
        assert left.conn._ring_out is None and right.conn._ring_out is None
        assert left.conn.bytes_through_ring == right.conn.bytes_through_ring == 0
    finally:
        for side in (left, right):
            side.conn.close()
            side.io.stop()
        a.close()
        b.close()


def test_a_side_that_cannot_make_a_ring_offers_none(
    rings_here: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No memfd to be had (``RingWriter`` fails, as at a descriptor limit): the side sends an
    empty offer, the peer stops taking descriptors, and what it sends still goes through the
    peer's ring the other way."""

    def refuse(size: int) -> _ring.RingWriter:
        raise OSError(24, "Too many open files")

    a, b = socket.socketpair()
    real = _ring.RingWriter
    monkeypatch.setattr(_ring, "RingWriter", refuse)
    left = _connect(a, 1)
    left.io.call_soon(lambda: monkeypatch.setattr(_ring, "RingWriter", real))
    try:
        assert _wait(lambda: _ring.RingWriter is real)
        right = _connect(b, 0)
        try:
            assert _wait(lambda: not right.conn._ring_pending and right.conn._ring_out is not None)
            assert left.conn._ring_out is None
            data = [pattern(100_000, 1)]
            _send(right, data, 1)
            _send(left, data, 2)
            assert bytes(left.owner.wait_for(1)[0].buffers[0]) == bytes(data[0])
            assert bytes(right.owner.wait_for(1)[0].buffers[0]) == bytes(data[0])
            assert left.conn.bytes_through_ring == 100_000  # (right's ring)
            assert right.conn.bytes_through_ring == 0
        finally:
            right.conn.close()
            right.io.stop()
    finally:
        left.conn.close()
        left.io.stop()
        a.close()
        b.close()


# -- a raw peer that misbehaves --------------------------------------------------------------------
@pytest.fixture
def raw(rings_here: None) -> Iterator[tuple[Side, socket.socket]]:
    a, b = socket.socketpair()
    b.settimeout(5.0)
    side = _connect(a, 1)
    try:
        yield side, b
    finally:
        side.conn.close()
        side.io.stop()
        a.close()
        b.close()


def _offer(peer: socket.socket, fd: int, size: int) -> None:
    offer = encode_frame(Kind.RING_OFFER, 0, _ring.OFFER.pack(size))
    peer.sendmsg(offer, [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("i", fd))])


def _read_kinds(peer: socket.socket, want: int) -> list[int]:
    """The kinds of the frames the connection sent, until one of kind ``want`` came."""
    kinds: list[int] = []
    while want not in kinds:
        head = peer.recv(HEADER.size, socket.MSG_WAITALL)
        kind, _flags, nbuf, meta_len, _id = HEADER.unpack(head)
        assert nbuf == 0
        if meta_len:
            peer.recv(meta_len, socket.MSG_WAITALL)
        kinds.append(kind)
    return kinds


def _ring_frame(position: int, n: int) -> list[bytes | memoryview]:
    view = memoryview(bytearray(n))
    return encode_frame_placed(Kind.REQUEST, 1, b"m", [view], 0, [position + 1])


def test_a_reference_outside_the_ring_drops_the_connection(
    raw: tuple[Side, socket.socket],
) -> None:
    side, peer = raw
    writer = _ring.RingWriter(SIZE)
    assert writer.fd is not None
    _offer(peer, writer.fd, SIZE)
    writer.close_fd()
    assert Kind.RING_ACCEPT in _read_kinds(peer, Kind.RING_ACCEPT)
    peer.sendall(b"".join(bytes(p) for p in _ring_frame(SIZE - 10, 100)))
    assert side.owner.closed.wait(5)
    assert isinstance(side.owner.error, ProtocolError)
    assert "outside the ring" in str(side.owner.error)
    assert side.owner.frames == []


def test_a_ring_reference_without_a_ring_drops_the_connection(
    raw: tuple[Side, socket.socket],
) -> None:
    side, peer = raw
    peer.sendall(b"".join(bytes(p) for p in encode_frame(Kind.RING_OFFER, 0)))  # (none)
    peer.sendall(b"".join(bytes(p) for p in _ring_frame(0, 100)))
    assert side.owner.closed.wait(5)
    assert isinstance(side.owner.error, ProtocolError)
    assert "does not have" in str(side.owner.error)


def test_an_unsealed_ring_is_refused_and_drops_the_connection(
    raw: tuple[Side, socket.socket],
) -> None:
    side, peer = raw
    fd = os.memfd_create("unsealed", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, _ring.header_bytes(SIZE) + SIZE)
        _offer(peer, fd, SIZE)
    finally:
        os.close(fd)
    assert side.owner.closed.wait(5)
    assert isinstance(side.owner.error, ProtocolError)
    assert "sealed" in str(side.owner.error)


def test_an_offer_without_its_descriptor_drops_the_connection(
    raw: tuple[Side, socket.socket],
) -> None:
    side, peer = raw
    peer.sendall(
        b"".join(bytes(p) for p in encode_frame(Kind.RING_OFFER, 0, _ring.OFFER.pack(SIZE)))
    )
    assert side.owner.closed.wait(5)
    assert isinstance(side.owner.error, ProtocolError)
    assert "malformed ring offer" in str(side.owner.error)


def test_an_accept_for_a_ring_not_offered_drops_the_connection(
    raw: tuple[Side, socket.socket],
) -> None:
    side, peer = raw
    kinds = _read_kinds(peer, Kind.RING_OFFER)  # the connection offered its ring...
    assert kinds[-1] == Kind.RING_OFFER
    peer.sendall(b"".join(bytes(p) for p in encode_frame(Kind.RING_ACCEPT, 0)))
    peer.sendall(b"".join(bytes(p) for p in encode_frame(Kind.RING_ACCEPT, 0)))  # ...once
    assert side.owner.closed.wait(5)
    assert isinstance(side.owner.error, ProtocolError)
    assert "not offered" in str(side.owner.error)


def test_an_acceptance_read_at_once_by_another_thread_finds_the_ring_offered(
    rings_here: None,
) -> None:
    """The ring counts as offered before its offer leaves: a thread that holds the read role
    (a caller waiting in ``recv``) can read the peer's acceptance before the I/O thread that
    wrote the offer runs on. (It was marked after the write, and such an acceptance dropped the
    connection as "accepted a ring that was not offered": test_failure_bound in a CI run.)"""
    a, peer = socket.socketpair()
    peer.settimeout(5.0)
    side = _connect(a, 1, start=False)
    conn = side.conn
    send_fd = conn._send_fd

    def read_now(conn: Connection) -> None:  # (what a caller holding the read role does)
        deadline = time.monotonic() + 5
        while conn._ring_out is None and not conn.closed and time.monotonic() < deadline:
            conn._read_step()
            time.sleep(0.002)

    def send_fd_then_race(pieces: list[bytes | memoryview], fd: int) -> bool:
        sent = send_fd(pieces, fd)
        if sent:  # the peer accepts at once, and another thread reads it before we go on
            assert _read_kinds(peer, Kind.RING_OFFER)[-1] == Kind.RING_OFFER
            peer.sendall(b"".join(bytes(p) for p in encode_frame(Kind.RING_ACCEPT, 0)))
            reader = threading.Thread(target=read_now, args=(conn,), name="test-caller")
            reader.start()
            reader.join(10)
        return sent

    conn._send_fd = send_fd_then_race  # type: ignore[method-assign]
    try:
        side.io.call_soon(conn.start)
        assert _wait(lambda: conn._ring_out is not None or conn.closed)
        assert not conn.closed, conn.close_error
        assert conn._ring_out is not None
    finally:
        conn.close()
        side.io.stop()
        a.close()
        peer.close()


def test_a_second_ring_offer_is_ignored_and_the_first_ring_kept(
    raw: tuple[Side, socket.socket],
) -> None:
    """A peer that offers a ring twice (a duplicated frame, or a confused peer): the second
    offer is ignored -- its descriptor closed, nothing remapped -- and buffers placed in the
    first ring still arrive, bit-exact; the connection stays up."""
    side, peer = raw
    first, second = _ring.RingWriter(SIZE), _ring.RingWriter(SIZE)
    for writer in (first, second):
        assert writer.fd is not None
        _offer(peer, writer.fd, SIZE)
        writer.close_fd()
    assert Kind.RING_ACCEPT in _read_kinds(peer, Kind.RING_ACCEPT)
    data = pattern(100_000, 7)
    position = first.place(memoryview(data))
    assert position >= 0
    peer.sendall(b"".join(bytes(p) for p in _ring_frame(position, len(data))))
    got = side.owner.wait_for(1)
    assert bytes(got[0].buffers[0]) == bytes(data)
    assert not side.owner.closed.is_set()


# -- the frame parser's side -----------------------------------------------------------------------
@dataclass
class FakeRing:
    """A ring's reading side that records what it was asked for."""

    taken: list[tuple[int, int]] = field(default_factory=list)

    def take(self, position: int, n: int) -> memoryview:
        self.taken.append((position, n))
        return memoryview(bytearray([position % 251]) * n)


def test_the_parser_takes_ring_buffers_in_place_and_the_rest_inline() -> None:
    """A frame mixing ring slots and inline buffers, read a few bytes at a time: the ring ones
    are taken at their positions, in order; the others come from the stream."""
    inline = [pattern(10, 1), pattern(70_000, 2)]
    views = [memoryview(bytearray(300)), memoryview(inline[0]), memoryview(bytearray(5000))]
    views.append(memoryview(inline[1]))
    pieces = encode_frame_placed(Kind.RESPONSE, 9, b"pickle", views, 1, [65, 0, 129, 0])
    stream = b"".join(bytes(p) for p in pieces)
    parser = _frames.FrameParser(1 << 30)
    ring = FakeRing()
    parser.read_ring = ring
    (frame,) = feed(parser, stream, [7, 1, 100, 3])
    assert ring.taken == [(64, 300), (128, 5000)]
    assert frame.flags == 1 and frame.meta == b"pickle" and frame.message_id == 9
    assert bytes(frame.buffers[0]) == bytes([64]) * 300
    assert bytes(frame.buffers[1]) == bytes(inline[0])
    assert bytes(frame.buffers[2]) == bytes([128]) * 5000
    assert bytes(frame.buffers[3]) == bytes(inline[1])
    assert parser.bytes_from_ring == 5300


def test_a_whole_frame_takes_its_ring_buffers_in_one_pass() -> None:
    """The same frame arriving in one read: the one-pass path takes the ring buffers at their
    positions, in order, and the inline ones from the stream."""
    inline = [pattern(10, 1), pattern(1000, 2)]
    views = [memoryview(bytearray(300)), memoryview(inline[0]), memoryview(bytearray(5000))]
    views.append(memoryview(inline[1]))
    pieces = encode_frame_placed(Kind.RESPONSE, 9, b"pickle", views, 1, [65, 0, 129, 0])
    parser = _frames.FrameParser(1 << 30)
    parser.read_ring = ring = FakeRing()
    general = parser._parse_one
    parser._parse_one = lambda: pytest.fail("the general parser was used")  # type: ignore[method-assign]
    (frame,) = _feed_all(parser, b"".join(bytes(p) for p in pieces))
    parser._parse_one = general  # type: ignore[method-assign]
    assert ring.taken == [(64, 300), (128, 5000)]
    assert frame.flags == 1 and frame.meta == b"pickle" and frame.message_id == 9
    assert [bytes(b) for b in frame.buffers] == [
        bytes([64]) * 300,
        bytes(inline[0]),
        bytes([128]) * 5000,
        bytes(inline[1]),
    ]
    assert parser.bytes_from_ring == 5300


def test_the_parser_refuses_ring_slots_without_a_ring_and_a_slot_also_by_reference() -> None:
    views = [memoryview(bytearray(300))]
    stream = b"".join(bytes(p) for p in encode_frame_placed(Kind.REQUEST, 1, b"", views, 0, [1]))
    with pytest.raises(ProtocolError, match="does not have"):
        _feed_all(_frames.FrameParser(1 << 30), stream)
    both = encode_frame_placed(Kind.REQUEST, 1, b"", views, 0, [1], 5, [4096])
    parser = _frames.FrameParser(1 << 30, read_remote=lambda address, into: None)
    parser.read_ring = FakeRing()
    with pytest.raises(ProtocolError, match="both"):
        _feed_all(parser, b"".join(bytes(p) for p in both))


def _feed_all(parser: _frames.FrameParser, stream: bytes) -> list[Frame]:
    return feed(parser, stream)
