"""The connection handshake: mutual HMAC-SHA256 challenge-response over the cluster secret.

::

    client -> server  HELLO      magic "DGRD", version, flags, client rank, client
                                 incarnation (u64), client nonce (32)
    server -> client  CHALLENGE  magic, version, flags, server rank, server incarnation,
                                 server nonce (32),
                                 HMAC(secret, "server" | nonces | ranks | incarnations)
    client -> server  PROOF      HMAC(secret, "client" | nonces | ranks | incarnations)
    server -> client  ACCEPT     one byte

The incarnation is the random id of one start of a worker's agent (a worker relaunched under
the same rank has a new one): the transport tells a new incarnation from the one it knew.

Every message has a fixed size, so nothing read before the peer has proven knowledge of the
secret is ever unpickled, and no length read from an unauthenticated peer is ever trusted.
Both MACs bind both nonces, both ranks and both incarnations, and the labels differ, so a MAC
seen in one role can't be replayed in the other. A peer that fails any step is dropped.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
import socket
import ssl
import struct

from .._errors import HandshakeError

__all__ = [
    "PROTOCOL_VERSION",
    "PeerClosedHandshake",
    "client_handshake",
    "server_accept",
    "server_handshake",
]

MAGIC = b"DGRD"
PROTOCOL_VERSION = 4  # 3: shared-memory rings (frame kinds RING_OFFER, RING_ACCEPT); 4: rings of
# chunks, freed in any order (buffers lent to received tensors)
_HELLO = struct.Struct("<4sHHIQ32s")
_CHALLENGE = struct.Struct("<4sHHIQ32s32s")
_PROOF_SIZE = 32
_ACCEPT = b"\x01"


class PeerClosedHandshake(HandshakeError):
    """The peer closed the connection before the handshake was done (a worker under load
    closes connections it has no handshake slot for; retried by the client)."""


def _mac(
    secret: bytes,
    label: bytes,
    nonce_c: bytes,
    nonce_s: bytes,
    rc: int,
    rs: int,
    ic: int,
    is_: int,
) -> bytes:
    message = (
        b"distgrad-auth-v2|"
        + label
        + b"|"
        + nonce_c
        + nonce_s
        + struct.pack("<IIQQ", rc, rs, ic, is_)
    )
    return hmac.new(secret, message, hashlib.sha256).digest()


def _check_magic(magic: bytes, version: int) -> None:
    if magic != MAGIC:
        raise HandshakeError("peer is not a distgrad worker (bad handshake magic)")
    if version != PROTOCOL_VERSION:
        raise HandshakeError(
            f"peer speaks distgrad wire protocol {version}, this worker speaks {PROTOCOL_VERSION}"
        )


# -- client side: blocking, runs on the thread that opens the connection ------------------------
def _recv_exact_blocking(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise PeerClosedHandshake("connection closed by the peer during the handshake")
        got += k
    return bytes(buf)


def client_handshake(
    sock: socket.socket, secret: bytes, my_rank: int, peer_rank: int, incarnation: int = 0
) -> int:
    """Authenticate to a server on a blocking socket (with a timeout set); raise on failure.
    Return the server's incarnation."""
    nonce_c = os.urandom(32)
    sock.sendall(_HELLO.pack(MAGIC, PROTOCOL_VERSION, 0, my_rank, incarnation, nonce_c))
    magic, version, _flags, rank_s, inc_s, nonce_s, mac_s = _CHALLENGE.unpack(
        _recv_exact_blocking(sock, _CHALLENGE.size)
    )
    _check_magic(magic, version)
    if rank_s != peer_rank:
        raise HandshakeError(f"expected to reach rank {peer_rank}, but rank {rank_s} answered")
    ids = (my_rank, rank_s, incarnation, inc_s)
    if not hmac.compare_digest(mac_s, _mac(secret, b"server", nonce_c, nonce_s, *ids)):
        raise HandshakeError("peer failed authentication (does it use the same cluster secret?)")
    sock.sendall(_mac(secret, b"client", nonce_c, nonce_s, *ids))
    if _recv_exact_blocking(sock, 1) != _ACCEPT:
        raise HandshakeError("peer rejected the handshake")
    return int(inc_s)


# -- server side: a coroutine on the I/O loop over a non-blocking socket ---------------------------
async def _wait_io(loop: asyncio.AbstractEventLoop, sock: socket.socket, write: bool) -> None:
    fut: asyncio.Future[None] = loop.create_future()
    fd = sock.fileno()

    def ready() -> None:
        if not fut.done():
            fut.set_result(None)

    if write:
        loop.add_writer(fd, ready)
    else:
        loop.add_reader(fd, ready)
    try:
        await fut
    finally:
        if write:
            loop.remove_writer(fd)
        else:
            loop.remove_reader(fd)


async def wait_readable(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
    """Wait until ``sock`` has bytes to read (or EOF)."""
    await _wait_io(loop, sock, write=False)


async def recv_exact(loop: asyncio.AbstractEventLoop, sock: socket.socket, n: int) -> bytes:
    """Read exactly ``n`` bytes from a non-blocking (possibly TLS) socket."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        try:
            k = sock.recv_into(view[got:])
        except (BlockingIOError, ssl.SSLWantReadError):
            await _wait_io(loop, sock, write=False)
            continue
        except ssl.SSLWantWriteError:
            await _wait_io(loop, sock, write=True)
            continue
        if k == 0:
            raise HandshakeError("connection closed by the peer during the handshake")
        got += k
    return bytes(buf)


async def send_all(loop: asyncio.AbstractEventLoop, sock: socket.socket, data: bytes) -> None:
    """Write all of ``data`` to a non-blocking (possibly TLS) socket."""
    view = memoryview(data)
    while view:
        try:
            k = sock.send(view)
        except (BlockingIOError, ssl.SSLWantWriteError):
            await _wait_io(loop, sock, write=True)
            continue
        except ssl.SSLWantReadError:
            await _wait_io(loop, sock, write=False)
            continue
        view = view[k:]


async def tls_server_handshake(loop: asyncio.AbstractEventLoop, sock: ssl.SSLSocket) -> None:
    """Drive a non-blocking TLS handshake to completion."""
    while True:
        try:
            sock.do_handshake()
            return
        except ssl.SSLWantReadError:
            await _wait_io(loop, sock, write=False)
        except ssl.SSLWantWriteError:
            await _wait_io(loop, sock, write=True)


async def server_handshake(
    loop: asyncio.AbstractEventLoop,
    sock: socket.socket,
    secret: bytes,
    my_rank: int,
    world_size: int,
) -> int:
    """Authenticate a client on a non-blocking socket; return its (proven) rank."""
    rank, _incarnation = await server_accept(loop, sock, secret, my_rank, world_size, 0)
    return rank


async def server_accept(
    loop: asyncio.AbstractEventLoop,
    sock: socket.socket,
    secret: bytes,
    my_rank: int,
    world_size: int,
    incarnation: int,
) -> tuple[int, int]:
    """Authenticate a client on a non-blocking socket; return its (proven) rank and
    incarnation. ``world_size`` 0 accepts any rank (a dynamic group)."""
    magic, version, _flags, rank_c, inc_c, nonce_c = _HELLO.unpack(
        await recv_exact(loop, sock, _HELLO.size)
    )
    _check_magic(magic, version)
    if world_size > 0 and not 0 <= rank_c < world_size:
        raise HandshakeError(f"peer claims rank {rank_c}, outside the group of {world_size}")
    nonce_s = os.urandom(32)
    ids = (rank_c, my_rank, inc_c, incarnation)
    mac_s = _mac(secret, b"server", nonce_c, nonce_s, *ids)
    await send_all(
        loop,
        sock,
        _CHALLENGE.pack(MAGIC, PROTOCOL_VERSION, 0, my_rank, incarnation, nonce_s, mac_s),
    )
    proof = await recv_exact(loop, sock, _PROOF_SIZE)
    if not hmac.compare_digest(proof, _mac(secret, b"client", nonce_c, nonce_s, *ids)):
        raise HandshakeError(f"peer claiming rank {rank_c} failed authentication")
    await send_all(loop, sock, _ACCEPT)
    return int(rank_c), int(inc_c)
