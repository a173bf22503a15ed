"""Unit tests of the authenticated connection handshake (``distgrad._transport._handshake``),
run over a real ``socket.socketpair()``: the client side blocking in a thread, the server side
on an asyncio loop, as in the transport."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
import socket
import struct
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from distgrad._errors import HandshakeError, ProtocolError
from distgrad._transport._handshake import (
    MAGIC,
    PROTOCOL_VERSION,
    client_handshake,
    server_handshake,
)

SECRET = b"the-cluster-secret"
HELLO = struct.Struct("<4sHHIQ32s")
CHALLENGE = struct.Struct("<4sHHIQ32s32s")
SERVER_RANK = 1
WORLD_SIZE = 4


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def handshake(
    loop: asyncio.AbstractEventLoop,
    client: Callable[[socket.socket], Any],
    server_secret: bytes = SECRET,
) -> tuple[Any, Any]:
    """Run ``client(sock)`` in a thread against ``server_handshake`` on the loop; return
    ``(client outcome, server outcome)`` where an outcome is a value or the exception raised."""
    client_sock, server_sock = socket.socketpair()
    client_sock.settimeout(5)
    server_sock.setblocking(False)
    outcome: dict[str, Any] = {}

    def run_client() -> None:
        try:
            outcome["client"] = client(client_sock)
        except BaseException as exc:
            outcome["client"] = exc
        finally:
            client_sock.close()

    thread = threading.Thread(target=run_client, daemon=True)
    thread.start()
    try:
        server: Any = loop.run_until_complete(
            asyncio.wait_for(
                server_handshake(loop, server_sock, server_secret, SERVER_RANK, WORLD_SIZE), 5
            )
        )
    except BaseException as exc:
        server = exc
    finally:
        server_sock.close()
    thread.join(5)
    assert not thread.is_alive()
    return outcome["client"], server


def mac(
    label: bytes, nonce_c: bytes, nonce_s: bytes, rc: int, rs: int, key: bytes = SECRET
) -> bytes:
    ids = struct.pack("<IIQQ", rc, rs, 0, 0)  # (incarnations: 0 on both sides here)
    message = b"distgrad-auth-v2|" + label + b"|" + nonce_c + nonce_s + ids
    return hmac.new(key, message, hashlib.sha256).digest()


def recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            break
        data += chunk
    return data


def test_same_secret_succeeds_and_returns_the_client_rank(loop: asyncio.AbstractEventLoop) -> None:
    """With the same secret both sides succeed and the server learns the client's rank."""
    client, server = handshake(loop, lambda s: client_handshake(s, SECRET, 2, SERVER_RANK))
    assert client == 0  # the server's incarnation
    assert server == 2


@pytest.mark.parametrize("rank", [0, WORLD_SIZE - 1])
def test_every_rank_in_the_group_is_accepted(loop: asyncio.AbstractEventLoop, rank: int) -> None:
    """Ranks at both ends of the group are accepted."""
    client, server = handshake(loop, lambda s: client_handshake(s, SECRET, rank, SERVER_RANK))
    assert client == 0 and server == rank


def test_wrong_secret_fails_on_both_sides(loop: asyncio.AbstractEventLoop) -> None:
    """A client with another secret rejects the server's MAC, and the server fails too."""
    client, server = handshake(
        loop, lambda s: client_handshake(s, b"another-secret", 2, SERVER_RANK)
    )
    assert isinstance(client, HandshakeError), client
    assert "failed authentication" in str(client)
    assert isinstance(server, HandshakeError), server


def test_forged_proof_is_rejected(loop: asyncio.AbstractEventLoop) -> None:
    """A client that ignores the challenge and sends a made-up proof gets no ACCEPT."""

    def forger(sock: socket.socket) -> bytes:
        sock.sendall(HELLO.pack(MAGIC, PROTOCOL_VERSION, 0, 2, 0, os.urandom(32)))
        assert len(recv_exact(sock, CHALLENGE.size)) == CHALLENGE.size
        sock.sendall(os.urandom(32))
        return recv_exact(sock, 1)

    client, server = handshake(loop, forger)
    assert client == b""  # the server closed without accepting
    assert isinstance(server, HandshakeError)
    assert "failed authentication" in str(server)


def test_proof_made_with_the_wrong_secret_is_rejected(loop: asyncio.AbstractEventLoop) -> None:
    """A well-formed proof computed with another secret is rejected by the server."""

    def wrong_key(sock: socket.socket) -> bytes:
        nonce_c = os.urandom(32)
        sock.sendall(HELLO.pack(MAGIC, PROTOCOL_VERSION, 0, 2, 0, nonce_c))
        _m, _v, _f, rank_s, _inc, nonce_s, _mac = CHALLENGE.unpack(recv_exact(sock, CHALLENGE.size))
        sock.sendall(mac(b"client", nonce_c, nonce_s, 2, rank_s, key=b"guess"))
        return recv_exact(sock, 1)

    client, server = handshake(loop, wrong_key)
    assert client == b""
    assert isinstance(server, HandshakeError)


def test_server_mac_replayed_as_client_proof_is_rejected(loop: asyncio.AbstractEventLoop) -> None:
    """The server's own MAC sent back as the client's proof does not authenticate (labels)."""

    def replay(sock: socket.socket) -> bytes:
        sock.sendall(HELLO.pack(MAGIC, PROTOCOL_VERSION, 0, 2, 0, os.urandom(32)))
        *_rest, server_mac = CHALLENGE.unpack(recv_exact(sock, CHALLENGE.size))
        sock.sendall(server_mac)
        return recv_exact(sock, 1)

    client, server = handshake(loop, replay)
    assert client == b""
    assert isinstance(server, HandshakeError)


def test_correct_manual_proof_is_accepted(loop: asyncio.AbstractEventLoop) -> None:
    """The documented MAC construction is what the server checks (guards the tests above)."""

    def manual(sock: socket.socket) -> bytes:
        nonce_c = os.urandom(32)
        sock.sendall(HELLO.pack(MAGIC, PROTOCOL_VERSION, 0, 3, 0, nonce_c))
        magic, version, _f, rank_s, _inc, nonce_s, mac_s = CHALLENGE.unpack(
            recv_exact(sock, CHALLENGE.size)
        )
        assert (magic, version, rank_s) == (MAGIC, PROTOCOL_VERSION, SERVER_RANK)
        assert mac_s == mac(b"server", nonce_c, nonce_s, 3, rank_s)
        sock.sendall(mac(b"client", nonce_c, nonce_s, 3, rank_s))
        return recv_exact(sock, 1)

    client, server = handshake(loop, manual)
    assert client == b"\x01"
    assert server == 3


@pytest.mark.parametrize(
    "hello",
    [
        b"GET / HTTP/1.1\r\nHost: example\r\n\r\n" + b"x" * 20,
        HELLO.pack(b"DGRX", PROTOCOL_VERSION, 0, 0, 0, bytes(32)),
        bytes(HELLO.size),
    ],
    ids=["http", "near-magic", "zeros"],
)
def test_garbage_magic_fails(loop: asyncio.AbstractEventLoop, hello: bytes) -> None:
    """A first message without the magic fails the server's handshake; nothing is answered."""

    def garbage(sock: socket.socket) -> bytes:
        sock.sendall(hello[: HELLO.size])
        return recv_exact(sock, 1)

    client, server = handshake(loop, garbage)
    assert client == b""
    assert isinstance(server, HandshakeError)
    assert "bad handshake magic" in str(server)


def test_other_protocol_version_fails(loop: asyncio.AbstractEventLoop) -> None:
    """A peer speaking another protocol version is refused with a clear message."""

    def future_client(sock: socket.socket) -> bytes:
        sock.sendall(HELLO.pack(MAGIC, PROTOCOL_VERSION + 1, 0, 0, 0, bytes(32)))
        return recv_exact(sock, 1)

    client, server = handshake(loop, future_client)
    assert client == b""
    assert isinstance(server, HandshakeError)
    assert f"protocol {PROTOCOL_VERSION + 1}" in str(server)


@pytest.mark.parametrize("rank", [WORLD_SIZE, 2**32 - 1])
def test_rank_outside_the_group_fails(loop: asyncio.AbstractEventLoop, rank: int) -> None:
    """A client claiming a rank outside the group is refused before any challenge."""
    client, server = handshake(loop, lambda s: client_handshake(s, SECRET, rank, SERVER_RANK))
    assert isinstance(client, HandshakeError)
    assert isinstance(server, HandshakeError)
    assert f"claims rank {rank}" in str(server)


def test_client_refuses_an_unexpected_server_rank(loop: asyncio.AbstractEventLoop) -> None:
    """A client that reached another rank than the one it dialled refuses to continue."""
    client, server = handshake(loop, lambda s: client_handshake(s, SECRET, 0, SERVER_RANK + 1))
    assert isinstance(client, HandshakeError)
    assert f"expected to reach rank {SERVER_RANK + 1}" in str(client)
    assert isinstance(server, HandshakeError)


def test_client_refuses_a_server_that_is_not_distgrad() -> None:
    """A client talking to something that answers garbage fails with HandshakeError."""
    a, b = socket.socketpair()
    a.settimeout(5)

    def fake_server() -> None:
        recv_exact(b, HELLO.size)
        b.sendall(b"HTTP/1.1 400 Bad Request\r\n" + b"\0" * 200)

    thread = threading.Thread(target=fake_server, daemon=True)
    thread.start()
    with pytest.raises(HandshakeError, match="bad handshake magic"):
        client_handshake(a, SECRET, 0, SERVER_RANK)
    thread.join(5)
    a.close()
    b.close()


def test_peer_closing_midway_fails(loop: asyncio.AbstractEventLoop) -> None:
    """A client that hangs up half-way through its HELLO fails the server's handshake."""

    def quitter(sock: socket.socket) -> None:
        sock.sendall(MAGIC + b"\x01")

    client, server = handshake(loop, quitter)
    assert client is None
    assert isinstance(server, HandshakeError)
    assert "closed by the peer" in str(server)


def test_handshake_errors_are_protocol_errors() -> None:
    """HandshakeError is a ProtocolError and a RuntimeError (caught as torch's errors are)."""
    assert issubclass(HandshakeError, ProtocolError)
    assert issubclass(HandshakeError, RuntimeError)
