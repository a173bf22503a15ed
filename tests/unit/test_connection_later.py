"""Unit tests of frames that wait for the next write (``Connection.send_later``), over a real
socket pair: they cost no write of their own, follow the next frame in the same stream, are
written by ``flush_later`` (the heartbeat tick) when no frame comes, go before a goodbye, and
are refused on a closed connection."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from distgrad._errors import PeerFailureError
from distgrad._transport._connection import Connection
from distgrad._transport._io import IoThread
from distgrad._wire._frames import FrameParser, Kind, encode_frame


@pytest.fixture
def pair() -> Iterator[tuple[Connection, socket.socket]]:
    a, b = socket.socketpair()
    a.setblocking(False)
    b.settimeout(2.0)
    io = IoThread()
    io.start()
    conn = Connection(None, io, a, 1, "worker w1 (rank 1)", 1 << 20)  # type: ignore[arg-type]
    try:
        yield conn, b
    finally:
        conn.close()
        io.stop()
        a.close()
        b.close()


def _frames(sock: socket.socket, count: int) -> list[tuple[int, bytes]]:
    """Read exactly ``count`` frames: (kind, meta) each."""
    parser = FrameParser(1 << 20)
    got: list[tuple[int, bytes]] = []
    while len(got) < count:
        buffer = parser.get_buffer()
        n = sock.recv_into(buffer)
        assert n > 0, "connection closed early"
        got.extend((frame.kind, bytes(frame.meta)) for frame in parser.buffer_updated(n))
    assert len(got) == count
    return got


def _nothing_to_read(sock: socket.socket) -> bool:
    sock.setblocking(False)
    try:
        sock.recv(1)
    except BlockingIOError:
        return True
    finally:
        sock.settimeout(2.0)
    return False


def test_a_later_frame_waits_for_the_next_write_and_follows_its_frame(
    pair: tuple[Connection, socket.socket],
) -> None:
    conn, peer = pair
    conn.send_later(encode_frame(Kind.NOTIFY, 0, b"cleanup-1"))
    conn.send_later(encode_frame(Kind.NOTIFY, 0, b"cleanup-2"))
    assert _nothing_to_read(peer)  # no write of its own
    conn.send_frame(Kind.REQUEST, 7, b"request")
    assert _frames(peer, 3) == [
        (Kind.REQUEST, b"request"),  # the write's own frame first: it is what the peer waits for
        (Kind.NOTIFY, b"cleanup-1"),
        (Kind.NOTIFY, b"cleanup-2"),
    ]
    conn.send_frame(Kind.REQUEST, 8, b"next")  # sent once only
    assert _frames(peer, 1) == [(Kind.REQUEST, b"next")]


def test_flush_writes_later_frames_when_no_frame_comes(
    pair: tuple[Connection, socket.socket],
) -> None:
    conn, peer = pair
    conn.flush_later()  # nothing queued: nothing written
    assert _nothing_to_read(peer)
    conn.send_later(encode_frame(Kind.NOTIFY, 0, b"cleanup"))
    conn.flush_later()
    assert _frames(peer, 1) == [(Kind.NOTIFY, b"cleanup")]
    conn.flush_later()
    assert _nothing_to_read(peer)


def test_later_frames_go_before_the_goodbye(pair: tuple[Connection, socket.socket]) -> None:
    """After a goodbye the peer takes no work, so what waited must go first."""
    conn, peer = pair
    conn.send_later(encode_frame(Kind.NOTIFY, 0, b"cleanup"))
    conn.close_when_flushed()
    assert _frames(peer, 2) == [(Kind.NOTIFY, b"cleanup"), (Kind.GOODBYE, b"")]


def test_a_closed_connection_refuses_and_drops_later_frames(
    pair: tuple[Connection, socket.socket],
) -> None:
    conn, peer = pair
    conn.send_later(encode_frame(Kind.NOTIFY, 0, b"cleanup"))
    conn.close()
    with pytest.raises(PeerFailureError):
        conn.send_later(encode_frame(Kind.NOTIFY, 0, b"more"))
    conn.flush_later()  # dropped with the connection: nothing to write, no error
    assert peer.recv(1) == b""  # the peer sees the close and nothing else
