"""Unit tests of a connection's read role (``_poller``, ``Connection.read_until``,
``Connection.serve_lingering``), over a real socket pair: a caller waiting alone reads its own
answer on its own thread (the I/O thread reads nothing meanwhile), hands the role back so that
the I/O thread reads what comes after, gives up at once when another thread holds the role,
and returns when the connection is closed under it or its time is up; a worker lingering on
its connection hands on the next request (and the notifications before it) itself, and
leaves every other frame -- and what follows it -- to the I/O thread, in order."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from distgrad._rpc._core._pool import ThreadPool
from distgrad._transport import _connection
from distgrad._transport._connection import Connection
from distgrad._transport._io import IoThread
from distgrad._transport._poller import ReadPoller, available
from distgrad._wire._frames import Frame, Kind, encode_frame

pytestmark = pytest.mark.skipif(not available(), reason="needs epoll (Linux)")


@dataclass
class Owner:
    """Records the frames handed on and the thread each was handed on by; releases
    ``answered`` at a RESPONSE (as the agent releases a waiting caller's lock)."""

    answered: threading.Lock = field(default_factory=threading.Lock)
    frames: list[tuple[int, int, str]] = field(default_factory=list)  # kind, id, thread
    got: threading.Event = field(default_factory=threading.Event)
    closed: threading.Event = field(default_factory=threading.Event)

    def on_frame(self, conn: Connection, frame: Frame) -> None:
        self.frames.append((frame.kind, frame.message_id, threading.current_thread().name))
        self.got.set()
        if frame.kind == Kind.RESPONSE:
            self.answered.release()

    def on_closed(self, conn: Connection, error: Exception | None) -> None:
        self.closed.set()


@dataclass
class Pair:
    conn: Connection
    peer: socket.socket
    owner: Owner
    io: IoThread


def _tcp_pair() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as server:
        a = socket.create_connection(server.getsockname())
        b, _ = server.accept()
    return a, b


@pytest.fixture(params=["unix", "tcp"])
def pair(request: pytest.FixtureRequest) -> Iterator[Pair]:
    """A connection over a Unix socket pair (its read role's holder waits in ``recv``) or over
    TCP on loopback (the holder waits in ``poll``), and the raw peer socket."""
    a, b = socket.socketpair() if request.param == "unix" else _tcp_pair()
    a.setblocking(False)
    b.settimeout(5.0)
    io = IoThread(name="test-io")
    io.start()
    poller = ReadPoller(io)
    io.call_soon(poller.start)
    owner = Owner()
    owner.answered.acquire()  # (the "call" waits for it)
    conn = Connection(owner, io, a, 1, "worker w1 (rank 1)", 1 << 20)
    conn.poller = poller
    io.call_soon(conn.start)
    try:
        yield Pair(conn, b, owner, io)
    finally:
        conn.close()
        io.call_soon(poller.close)
        io.stop()
        a.close()
        b.close()


def _read_in_thread(conn: Connection, lock: threading.Lock, timeout: float) -> list[bool]:
    """``conn.read_until(lock, timeout)`` on a thread named test-caller; its result."""
    result: list[bool] = []
    thread = threading.Thread(
        target=lambda: result.append(conn.read_until(lock, timeout)), name="test-caller"
    )
    thread.start()
    thread.join(10)
    assert not thread.is_alive(), "read_until did not return"
    return result


def _until_held(conn: Connection) -> None:
    """Wait until a caller holds ``conn``'s read role (nothing else reads in these tests)."""
    deadline = time.monotonic() + 10
    while not conn.reading.locked():
        assert time.monotonic() < deadline, "the caller never took the read role"
        time.sleep(0.001)


def test_a_caller_reads_its_own_answer_and_the_loop_reads_nothing(pair: Pair) -> None:
    """Frames that come while a caller waits are read and handed on by the caller's thread
    (a heartbeat before the answer too); the I/O thread hands on none of them."""
    started = threading.Event()

    def call() -> bool:
        started.set()
        return pair.conn.read_until(pair.owner.answered, 10.0)

    result: list[bool] = []
    thread = threading.Thread(target=lambda: result.append(call()), name="test-caller")
    thread.start()
    started.wait(5)
    _until_held(pair.conn)
    pair.peer.sendall(encode_frame(Kind.NOTIFY, 0, b"first")[0])
    pair.peer.sendall(encode_frame(Kind.RESPONSE, 7, b"answer")[0])
    thread.join(10)
    assert result == [True]
    assert [f[:2] for f in pair.owner.frames] == [(Kind.NOTIFY, 0), (Kind.RESPONSE, 7)]
    assert {f[2] for f in pair.owner.frames} == {"test-caller"}


def test_the_role_goes_back_to_the_loop(pair: Pair) -> None:
    """After the caller got its answer, frames that come are read by the I/O thread (the
    socket was armed again): nothing is left unread."""
    pair.peer.sendall(encode_frame(Kind.RESPONSE, 1, b"answer")[0])
    # (the loop or the caller reads it; either way the caller gets it -- handed over when the
    # loop held the role, and read_until said False at once)
    read = _read_in_thread(pair.conn, pair.owner.answered, 10.0)
    assert read == [True] or pair.owner.answered.acquire(timeout=10)
    pair.owner.got.clear()
    pair.peer.sendall(encode_frame(Kind.NOTIFY, 0, b"after")[0])
    assert pair.owner.got.wait(10), "a frame after the caller's answer was never read"
    assert pair.owner.frames[-1][:2] == (Kind.NOTIFY, 0)
    assert pair.owner.frames[-1][2] == "test-io"


def test_an_answer_in_pieces_is_waited_for_on_the_callers_thread(pair: Pair) -> None:
    """The caller waits itself (in ``recv`` on a Unix socket, in ``poll`` over TCP): an answer
    that comes in two pieces (the first ending mid-frame) is read piece by piece on the
    caller's thread until it is whole."""
    result: list[bool] = []
    thread = threading.Thread(
        target=lambda: result.append(pair.conn.read_until(pair.owner.answered, 10.0)),
        name="test-caller",
    )
    thread.start()
    _until_held(pair.conn)
    frame = _frame(Kind.RESPONSE, 9, b"a" * 5000)
    pair.peer.sendall(frame[:100])
    time.sleep(0.03)  # (the caller has read the first piece and waits again)
    assert not result
    pair.peer.sendall(frame[100:])
    thread.join(10)
    assert result == [True]
    assert [f[:2] for f in pair.owner.frames] == [(Kind.RESPONSE, 9)]
    assert pair.owner.frames[0][2] == "test-caller"


def test_no_write_and_no_read_of_the_loop_waits(pair: Pair) -> None:
    """A Unix socket stays in blocking mode (for the read role's holder to wait in ``recv``),
    so every other read and write is made non-blocking by its flags: a frame the
    peer does not take yet is queued (the sender returns at once) and written when the peer
    reads; the I/O thread reads what is there and is free for its next task."""
    unix = pair.conn._sock.family == socket.AF_UNIX
    assert pair.conn._sock.getblocking() == unix  # (the premise: a Unix socket blocks)
    big = _frame(Kind.REQUEST, 1, b"x" * (8 << 20))  # (more than the socket buffers hold)
    sender = threading.Thread(target=pair.conn.send, args=([big],), name="test-sender")
    sender.start()
    sender.join(5)
    assert not sender.is_alive(), "a write the peer did not take blocked the sender"
    pair.peer.sendall(_frame(Kind.NOTIFY, 0, b"hello"))
    assert pair.owner.got.wait(10)
    free = threading.Event()
    pair.io.call_soon(free.set)
    assert free.wait(5), "the I/O thread is stuck in a read"
    received = bytearray()
    while len(received) < len(big):
        chunk = pair.peer.recv(1 << 20)
        assert chunk, "the connection ended before the queued frame was written"
        received += chunk
    assert bytes(received) == big


def test_a_held_role_is_not_taken(pair: Pair) -> None:
    """While another thread holds the read role, a caller does not read: it returns False at
    once (and waits for its answer to be handed over)."""
    with pair.conn.reading:
        assert pair.conn.read_until(pair.owner.answered, 10.0) is False


def test_a_close_under_the_caller_ends_its_read(pair: Pair) -> None:
    """A connection closed by another thread while a caller reads it (its peer judged silent,
    the agent stopping) ends the read: read_until returns False, the role is given back."""
    started = threading.Event()
    result: list[bool] = []

    def call() -> None:
        started.set()
        result.append(pair.conn.read_until(pair.owner.answered, 0.0))  # (no timeout)

    thread = threading.Thread(target=call, name="test-caller")
    thread.start()
    started.wait(5)
    _until_held(pair.conn)
    pair.conn.close(None)
    thread.join(10)
    assert not thread.is_alive() and result == [False]
    assert pair.owner.closed.wait(10)
    assert pair.conn.reading.acquire(timeout=10)


def test_the_time_up_ends_the_read(pair: Pair) -> None:
    """With no answer, read_until returns False when its time is up, and the loop reads what
    comes later."""
    assert _read_in_thread(pair.conn, pair.owner.answered, 0.05) == [False]
    pair.peer.sendall(encode_frame(Kind.RESPONSE, 3, b"late")[0])
    assert pair.owner.answered.acquire(timeout=10), "the late answer was never read"


def _linger(pair: Pair, monkeypatch: pytest.MonkeyPatch, *frames: bytes) -> list[Frame | None]:
    """``serve_lingering`` on a thread named test-worker (lingering long enough for the test),
    with ``frames`` sent once it holds the read role; its result."""
    monkeypatch.setattr(_connection, "_LINGER", 10.0)
    result: list[Frame | None] = []
    thread = threading.Thread(
        target=lambda: result.append(pair.conn.serve_lingering()), name="test-worker"
    )
    thread.start()
    _until_held(pair.conn)
    pair.peer.sendall(b"".join(frames))
    thread.join(15)
    assert not thread.is_alive(), "serve_lingering did not return"
    return result


def _frame(kind: int, message_id: int, meta: bytes) -> bytes:
    return b"".join(bytes(piece) for piece in encode_frame(kind, message_id, meta))


def _ids(frames: list[Frame | None]) -> list[tuple[int, int] | None]:
    return [None if f is None else (f.kind, f.message_id) for f in frames]


def test_a_lingering_worker_takes_the_next_request_itself(
    pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request that comes while a worker lingers on the connection is returned to the
    worker (it runs it itself), not handed on; a second one in the same read is handed on by
    the worker's own thread (the agent gives it to another worker)."""
    taken = _linger(pair, monkeypatch, _frame(Kind.REQUEST, 5, b"call"))
    assert _ids(taken) == [(Kind.REQUEST, 5)] and taken[0] is not None
    assert taken[0].meta == b"call"
    assert pair.owner.frames == []
    taken = _linger(pair, monkeypatch, _frame(Kind.REQUEST, 6, b"a"), _frame(Kind.REQUEST, 7, b"b"))
    assert _ids(taken) == [(Kind.REQUEST, 6)]
    assert pair.owner.frames == [(Kind.REQUEST, 7, "test-worker")]


def test_an_answer_and_what_follows_go_to_the_io_thread_in_order(
    pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Requests and notifications read by a lingering worker are handed on by its own thread,
    in order; an answer (whose handlers belong to the I/O thread) is handed on by the I/O
    thread, and so is every frame after it in that read -- a request included -- in order;
    then the I/O thread reads what comes next."""
    sent = (
        _frame(Kind.REQUEST, 1, b"a"),
        _frame(Kind.NOTIFY, 0, b"n"),
        _frame(Kind.RESPONSE, 7, b"r"),
        _frame(Kind.REQUEST, 2, b"b"),
    )
    assert _ids(_linger(pair, monkeypatch, *sent)) == [(Kind.REQUEST, 1)]
    deadline = time.monotonic() + 10
    while len(pair.owner.frames) < 3:
        assert time.monotonic() < deadline, pair.owner.frames
        time.sleep(0.001)
    assert pair.owner.frames == [  # (request 1: returned to the worker, not handed on)
        (Kind.NOTIFY, 0, "test-worker"),
        (Kind.RESPONSE, 7, "test-io"),
        (Kind.REQUEST, 2, "test-io"),
    ]
    pair.owner.got.clear()
    pair.peer.sendall(_frame(Kind.NOTIFY, 0, b"later"))
    assert pair.owner.got.wait(10), "the read role never came back to the I/O thread"
    assert pair.owner.frames[-1] == (Kind.NOTIFY, 0, "test-io")


def test_frames_of_a_retired_connection_are_dropped(
    pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once the transport retired a connection (its peer's incarnation was replaced), what
    is still read on it is handed to nobody: not a request to a lingering worker, not an
    answer to the I/O thread's handler."""
    pair.conn.retired = True
    assert _linger(pair, monkeypatch, _frame(Kind.REQUEST, 1, b"a")) == [None]
    pair.peer.sendall(_frame(Kind.RESPONSE, 2, b"r") + _frame(Kind.NOTIFY, 0, b"n"))
    deadline = time.monotonic() + 10
    while pair.conn.readable_now():  # until the loop read them ...
        assert time.monotonic() < deadline
        time.sleep(0.001)
    with pair.conn.reading:  # ... and is done with that read (it holds the role meanwhile)
        pass
    assert pair.owner.frames == []
    pair.conn.retired = False
    pair.peer.sendall(_frame(Kind.NOTIFY, 0, b"n"))
    assert pair.owner.got.wait(10)
    assert pair.owner.frames == [(Kind.NOTIFY, 0, "test-io")]


def test_frames_go_where_the_transport_says(pair: Pair) -> None:
    """A connection hands complete frames to ``deliver`` (the transport points it straight at
    its frame handler), not through its owner."""
    seen: list[int] = []
    pair.conn.deliver = lambda conn, frame: seen.append(frame.message_id)
    pair.peer.sendall(_frame(Kind.NOTIFY, 9, b"n"))
    deadline = time.monotonic() + 10
    while not seen:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    assert seen == [9] and pair.owner.frames == []


def test_a_worker_lingers_on_after_notifications(
    pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Notifications alone do not end lingering (a context's cleanup comes between a peer's
    last gradient message and its next call): the worker hands them on, in order, and takes
    the request that comes after them, in a later read, itself."""
    monkeypatch.setattr(_connection, "_LINGER", 10.0)
    result: list[Frame | None] = []
    thread = threading.Thread(
        target=lambda: result.append(pair.conn.serve_lingering()), name="test-worker"
    )
    thread.start()
    _until_held(pair.conn)
    pair.peer.sendall(_frame(Kind.NOTIFY, 0, b"n1") + _frame(Kind.NOTIFY, 0, b"n2"))
    deadline = time.monotonic() + 10
    while len(pair.owner.frames) < 2:
        assert time.monotonic() < deadline, pair.owner.frames
        time.sleep(0.001)
    assert thread.is_alive(), "lingering ended at the notifications"
    pair.peer.sendall(_frame(Kind.REQUEST, 3, b"c"))
    thread.join(15)
    assert not thread.is_alive(), "serve_lingering did not return"
    assert _ids(result) == [(Kind.REQUEST, 3)]  # (returned to the worker, not handed on)
    assert pair.owner.frames == [
        (Kind.NOTIFY, 0, "test-worker"),
        (Kind.NOTIFY, 0, "test-worker"),
    ]


def test_lingering_that_finds_nothing_stops(pair: Pair) -> None:
    """Lingering that keeps finding nothing on a connection stops there: after a few empty
    lingers the worker does not even take the read role."""
    for _ in range(100):
        assert pair.conn.serve_lingering() is None  # (nothing is sent)
        if pair.conn._linger_credit <= 0:
            break
    assert pair.conn._linger_credit <= 0
    pair.owner.got.clear()
    assert pair.conn.serve_lingering() is None  # skipped: the role stays with the loop ...
    pair.peer.sendall(_frame(Kind.NOTIFY, 0, b"n"))
    assert pair.owner.got.wait(10)
    assert pair.owner.frames == [(Kind.NOTIFY, 0, "test-io")]  # ... which reads what comes


def test_a_lingering_pool_thread_is_not_busy() -> None:
    """A pool thread lingering counts as neither busy nor against the maximum; it does not
    linger while work waits for a thread."""
    pool = ThreadPool("test-pool", 1)
    lingering = threading.Event()
    go_on = threading.Event()
    seen: list[int] = []

    def task() -> None:
        assert pool.linger_start()
        lingering.set()
        go_on.wait(10)
        pool.linger_end()

    try:
        pool.submit(task)
        assert lingering.wait(10)
        seen.append(pool.busy())
        done = threading.Event()
        pool.submit(done.set)  # runs although the only slot's thread lingers
        assert done.wait(10)
        go_on.set()
    finally:
        go_on.set()
        pool.stop()
    assert seen == [0]


def test_a_pool_thread_does_not_linger_while_work_waits() -> None:
    """While a task waits for a thread (the backlog), a thread done with its own is told so
    (``waiting``: the worker then does not even take the read role) and may not linger."""
    pool = ThreadPool("test-pool", 1)
    release = threading.Event()
    answers: list[tuple[bool, bool]] = []

    def first() -> None:
        release.wait(10)
        answers.append((pool.waiting(), pool.linger_start()))

    try:
        assert not pool.waiting()
        pool.submit(first)
        pool.submit(lambda: None)  # (queued behind the first: the only slot is taken)
        release.set()
    finally:
        release.set()
        pool.stop()
    assert answers == [(True, False)]
    assert pool.waiting()  # (stopped)
