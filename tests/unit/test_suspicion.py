"""The suspicion logic (``_transport/_suspicion``) as both transports use it: the same cases run
against two socket transports (real Unix sockets, real handshakes) and two in-memory ones, and
must give the same verdicts -- suspected on a loss without proof, dead on proof only, nothing
held against a peer for a protocol error, a replaced incarnation refused."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from distgrad._errors import PeerFailureError, ProtocolError
from distgrad._transport._base import Link, PeerAddress, Transport, TransportConfig
from distgrad._transport._inmemory import MemoryNetwork
from distgrad._transport._io import IoThread
from distgrad._transport._suspicion import STALL, HeartbeatJudge, PeerVerdicts
from distgrad._transport._transport import SocketTransport
from distgrad._wire._frames import Frame, Kind

KINDS = ("socket", "memory")
_INTERVAL = 0.05
_PEER_TIMEOUT = 0.4


class Recorder:
    """A FrameHandler that keeps what it was told."""

    def __init__(self) -> None:
        self.frames: list[tuple[int, int]] = []  # (from rank, kind)
        self.lost: list[tuple[int, Exception, bool]] = []  # (rank, error, peer_dead)
        self._changed = threading.Condition()

    def on_frame(self, link: Link, frame: Frame) -> None:
        with self._changed:
            self.frames.append((link.peer, frame.kind))
            self._changed.notify_all()

    def on_connection_lost(self, link: Link, error: Exception, *, peer_dead: bool) -> None:
        with self._changed:
            self.lost.append((link.peer, error, peer_dead))
            self._changed.notify_all()

    def wait_for(self, condition: Callable[[], bool], timeout: float = 5.0) -> None:
        with self._changed:
            assert self._changed.wait_for(condition, timeout), "timed out"


class Pair:
    """Two transports of one kind, ranks 0 and 1, listening and knowing each other."""

    def __init__(self, kind: str, *, fail_stop: bool = False) -> None:
        self.kind = kind
        self.network = MemoryNetwork()
        self.ios = [IoThread(), IoThread()]
        self.handlers = [Recorder(), Recorder()]
        self.transports: list[Any] = []
        addresses: dict[int, PeerAddress] = {}
        for rank in (0, 1):
            config = TransportConfig(
                rank=rank,
                world_size=2,
                secret=b"suspicion cases",
                max_message_size=1 << 20,
                heartbeat_interval=_INTERVAL,
                peer_timeout=_PEER_TIMEOUT,
                handshake_timeout=2.0,
                connect_timeout=2.0,
                fail_stop=fail_stop and rank == 0,
                incarnation=int.from_bytes(os.urandom(8), "little") or 1,
            )
            self.ios[rank].start()
            factory = SocketTransport if kind == "socket" else self.network.factory
            transport = factory(config, self.ios[rank], self.handlers[rank], lambda r: f"rank {r}")
            self.transports.append(transport)
            addresses[rank] = transport.listen("127.0.0.1")
        for transport in self.transports:
            transport.set_peers(addresses)

    @property
    def t0(self) -> Transport:
        return self.transports[0]  # type: ignore[no-any-return]

    def links(self, rank: int) -> list[Any]:
        """The open links of transport ``rank`` (sockets: its connections)."""
        transport = self.transports[rank]
        found = transport._conns if self.kind == "socket" else transport._links
        return [link for link in list(found) if not link.closed]

    def send(self, src: int = 0, dst: int = 1) -> None:
        """A frame from ``src`` to ``dst``, waited for at ``dst``."""
        before = len(self.handlers[dst].frames)
        self.transports[src].connection(dst).send_frame(Kind.NOTIFY, 0, b"x")
        self.handlers[dst].wait_for(lambda: len(self.handlers[dst].frames) > before)

    def silence(self, rank: int) -> None:
        """Transport ``rank`` stops sending heartbeats (a frozen worker)."""
        transport = self.transports[rank]
        if self.kind == "memory":
            transport.pause()
            return
        done = threading.Event()

        def cancel() -> None:  # on its I/O thread: the pending tick is the one that reschedules
            if transport._heartbeat is not None:
                transport._heartbeat.cancel()
            done.set()

        self.ios[rank].call_soon(cancel)
        assert done.wait(2.0)

    def lost_at(self, rank: int) -> list[tuple[int, Exception, bool]]:
        return list(self.handlers[rank].lost)

    def close(self) -> None:
        for rank, transport in enumerate(self.transports):
            if self.kind == "memory" and transport.paused:
                transport.resume()
            transport.close(False)
            self.ios[rank].stop()


@pytest.fixture(params=KINDS)
def pair(request: pytest.FixtureRequest) -> Iterator[Pair]:
    made = Pair(request.param)
    try:
        yield made
    finally:
        made.close()


def _wait_lost(pair: Pair, rank: int = 0) -> tuple[int, Exception, bool]:
    pair.handlers[rank].wait_for(lambda: bool(pair.handlers[rank].lost))
    return pair.lost_at(rank)[0]


def test_a_link_lost_without_goodbye_makes_the_peer_suspected(pair: Pair) -> None:
    """A link closed by the peer without a goodbye: suspected, not dead; what waited fails
    (peer_dead), and the next send connects again, after which it is no longer suspected."""
    pair.send()
    for link in pair.links(1):
        link.close(PeerFailureError("reset", "rank 0"))
    peer, _error, peer_dead = _wait_lost(pair)
    assert (peer, peer_dead) == (1, True)
    assert pair.t0.is_suspected(1) and not pair.t0.is_dead(1)  # type: ignore[attr-defined]
    pair.send()  # a fresh connection
    assert not pair.t0.is_suspected(1)  # type: ignore[attr-defined]


def test_a_goodbye_proves_the_peer_dead(pair: Pair) -> None:
    """A peer that says goodbye (a graceful close) is dead: later sends fail at once."""
    pair.send()
    pair.transports[1].close(True)
    _wait_lost(pair)
    assert pair.t0.is_dead(1)
    with pytest.raises(PeerFailureError, match="rank 1"):
        pair.t0.check_alive(1)
    with pytest.raises(PeerFailureError):
        pair.t0.connection(1)


def test_fail_stop_makes_any_loss_a_death() -> None:
    """With fail_stop, a link lost without a goodbye proves the peer dead (torch's way)."""
    for kind in KINDS:
        made = Pair(kind, fail_stop=True)
        try:
            made.send()
            for link in made.links(1):
                link.close(PeerFailureError("reset", "rank 0"))
            _wait_lost(made)
            assert made.t0.is_dead(1), kind
        finally:
            made.close()


def test_a_protocol_error_condemns_the_link_not_the_peer(pair: Pair) -> None:
    """A link closed for a protocol error: what waited on it fails, but the peer is neither
    suspected nor dead, and the next send reaches it."""
    pair.send()
    for link in pair.links(0):
        link.close(ProtocolError("a malformed frame"))
    peer, _error, peer_dead = _wait_lost(pair)
    assert (peer, peer_dead) == (1, False)
    assert not pair.t0.is_dead(1) and not pair.t0.is_suspected(1)  # type: ignore[attr-defined]
    assert pair.t0.statistics().protocol_errors == 1
    pair.send()


def test_silence_past_the_peer_timeout_suspects_the_peer(pair: Pair) -> None:
    """A peer that sends nothing (not even heartbeats) past peer_timeout is suspected by the
    heartbeat check, not condemned."""
    pair.send()
    started = time.monotonic()
    pair.silence(1)
    _peer, error, peer_dead = _wait_lost(pair)
    waited = time.monotonic() - started
    assert "sent nothing for" in str(error) and peer_dead
    assert _PEER_TIMEOUT * 0.9 < waited < _PEER_TIMEOUT + 2.0
    assert pair.t0.is_suspected(1) and not pair.t0.is_dead(1)  # type: ignore[attr-defined]


def test_a_refused_connection_proves_the_peer_dead(pair: Pair) -> None:
    """A peer whose transport closed abruptly: the next send finds nothing listening, and the
    peer is dead from then on."""
    pair.send()
    pair.transports[1].close(False)
    _wait_lost(pair)
    with pytest.raises(PeerFailureError):
        pair.t0.connection(1).send_frame(Kind.NOTIFY, 0, b"x")
    assert pair.t0.is_dead(1)


def test_a_new_incarnation_replaces_the_old_one(pair: Pair) -> None:
    """Another incarnation of a rank closes the old one's links naming the restart, is itself
    reachable (not dead), and the old incarnation is refused from then on."""
    pair.send()
    old = pair.transports[1].config.incarnation
    new = old + 1
    assert pair.t0.note_incarnation(1, new)  # type: ignore[attr-defined]
    _peer, error, _dead = _wait_lost(pair)
    assert "restarted" in str(error)
    assert not pair.t0.is_dead(1)
    assert not pair.t0.note_incarnation(1, old)  # type: ignore[attr-defined]


def test_a_departed_member_is_dead_at_once(pair: Pair) -> None:
    """A member that left the group is dead: sends fail at once with the reason."""
    pair.t0.remove_peer(1, RuntimeError("worker w1 left the group"))
    assert pair.t0.is_dead(1)
    with pytest.raises(PeerFailureError, match="left the group"):
        pair.t0.check_alive(1)


# -- the shared logic itself -------------------------------------------------------------------
def _config() -> TransportConfig:
    return TransportConfig(0, 2, b"", 1 << 20, 0.1, 1.0, 1.0, 1.0)


def test_a_late_tick_judges_no_one_and_the_next_one_does() -> None:
    """A heartbeat tick far behind its time (this process stalled) judges no one and counts a
    stall; the tick after it judges again, even if late too."""
    judge = HeartbeatJudge(_config())
    judge.scheduled(100.0)
    assert judge.tick(100.1)  # on time
    judge.scheduled(100.1)
    assert not judge.tick(100.2 + STALL + 0.01)  # late: a stall
    assert judge.stalls == 1
    judge.scheduled(101.0)
    assert judge.tick(110.0)  # late again, but the previous one skipped
    assert judge.silent("rank 1", last_recv=99.5, now=100.0) is None
    error = judge.silent("rank 1", last_recv=98.0, now=100.0)
    assert error is not None and "sent nothing for 2.0s" in str(error)


def test_a_failed_reconnect_makes_a_suspected_peer_unreachable_for_a_moment() -> None:
    """A reconnect to a suspected peer that fails without proof makes calls in the next moment
    fail at once; a peer that is not suspected is not held back; an answer clears both."""
    verdicts = PeerVerdicts(lambda r: f"rank {r}", fail_stop=False)
    error = PeerFailureError("could not connect to rank 1: timed out", "rank 1")
    verdicts.reconnect_failed(1, error)
    verdicts.check_alive(1)  # not suspected: nothing held against it
    assert verdicts.link_lost(
        1, error, protocol_error=False, goodbye=False, nobody_listens=False, superseded=False
    )
    verdicts.reconnect_failed(1, error)
    with pytest.raises(PeerFailureError, match="timed out"):
        verdicts.check_alive(1)
    verdicts.answered(1)
    verdicts.check_alive(1)
    assert not verdicts.is_suspected(1) and not verdicts.is_dead(1)


def test_a_joiners_earlier_links_name_it_once_it_joined(pair: Pair) -> None:
    """A link opened before its peer's name was known (a joiner's handshake can arrive before
    the join) names the peer once it joined: the silence error says which worker it was (the
    marathon saw 'rank 2 sent nothing ...')."""
    names: dict[int, str] = {}

    def label(rank: int) -> str:
        return f"worker {names[rank]} (rank {rank})" if rank in names else f"rank {rank}"

    for transport in pair.transports:
        transport._label = label
    pair.send(0, 1)
    pair.send(1, 0)
    assert all(link.peer_label == "rank 1" for link in pair.links(0))
    names[1] = "m1"
    pair.t0.add_peer(1, pair.t0._peers[1])
    assert pair.links(0) and all(link.peer_label == "worker m1 (rank 1)" for link in pair.links(0))
    pair.silence(1)
    peer, error, _ = _wait_lost(pair)
    assert peer == 1 and "worker m1 (rank 1)" in str(error), error
