"""What an agent has done: its lifecycle state (:class:`AgentState`) and its counters, per
peer, as an :class:`AgentStatistics` snapshot (``RpcAgent.agent_statistics()``)."""

from __future__ import annotations

import enum
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field

from ..._transport._base import TransportStatistics

__all__ = ["AgentState", "AgentStatistics", "PeerStatistics", "StatisticsRecorder"]


class AgentState(enum.Enum):
    """Where an agent is in its life: ``CREATED`` -> ``LISTENING`` (transport started) ->
    ``RUNNING`` (peers known) -> ``STOPPING`` (``stop`` under way) -> ``STOPPED``."""

    CREATED = "created"
    LISTENING = "listening"
    RUNNING = "running"
    STOPPING = "stopping"
    STOPPED = "stopped"

    @property
    def stopped(self) -> bool:
        """True once ``stop`` began: nothing new is sent or served."""
        return self is AgentState.STOPPING or self is AgentState.STOPPED


@dataclass(frozen=True, slots=True)
class PeerStatistics:
    """This worker's traffic with one peer (itself included), since the agent started.

    Calls are requests this worker sent (user and internal calls; one-way notifications not
    included); requests are those it served. Bytes are message payloads (pickled metadata and
    tensor data), without frame headers."""

    calls_sent: int = 0
    #: calls that ended with an error: an error reply, a timeout, a peer failure, a shutdown
    calls_failed: int = 0
    #: calls whose request could not be written at all (the connection was found dead before
    #: any byte of it left) and were sent again on a fresh connection
    calls_resent: int = 0
    requests_served: int = 0
    #: requests answered with an error reply
    requests_failed: int = 0
    #: requests and one-way messages refused by this worker's allow-list (``allowed_calls``)
    requests_refused: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0


@dataclass(frozen=True, slots=True)
class AgentStatistics:
    """A snapshot of an agent's state and counters (``RpcAgent.agent_statistics()``)."""

    worker_name: str
    state: AgentState
    #: calls sent and not answered yet (user and internal)
    calls_in_flight: int
    #: requests being served now (including those waiting on nested calls)
    requests_in_flight: int
    #: by peer worker name
    peers: Mapping[str, PeerStatistics] = field(default_factory=dict)
    transport: TransportStatistics | None = None

    @property
    def calls_sent(self) -> int:
        return sum(p.calls_sent for p in self.peers.values())

    @property
    def calls_failed(self) -> int:
        return sum(p.calls_failed for p in self.peers.values())

    @property
    def calls_resent(self) -> int:
        return sum(p.calls_resent for p in self.peers.values())

    @property
    def requests_served(self) -> int:
        return sum(p.requests_served for p in self.peers.values())

    @property
    def requests_failed(self) -> int:
        return sum(p.requests_failed for p in self.peers.values())

    @property
    def requests_refused(self) -> int:
        return sum(p.requests_refused for p in self.peers.values())

    @property
    def bytes_sent(self) -> int:
        return sum(p.bytes_sent for p in self.peers.values())

    @property
    def bytes_received(self) -> int:
        return sum(p.bytes_received for p in self.peers.values())


# indices into a peer's counter list
_SENT, _FAILED, _SERVED, _SERVE_FAILED, _OUT, _IN, _RESENT, _REFUSED = range(8)


class StatisticsRecorder:
    """The agent's counters, per peer rank; cheap to update from any thread (one short lock)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._peers: dict[int, list[int]] = {}

    def __repr__(self) -> str:
        return f"StatisticsRecorder(peers={sorted(self._peers)})"

    def _counters(self, peer: int) -> list[int]:
        """(Under the lock.) ``peer``'s counters, made on first use. The per-call methods
        inline its common case: ``self._peers.get(peer) or self._counters(peer)``."""
        counters = self._peers.get(peer)
        if counters is None:
            counters = self._peers.setdefault(peer, [0] * 8)
        return counters

    def sent(self, peer: int, nbytes: int) -> None:
        """A call to ``peer`` went out."""
        with self._lock:
            counters = self._peers.get(peer) or self._counters(peer)
            counters[_SENT] += 1
            counters[_OUT] += nbytes

    def resent(self, peer: int) -> None:
        """A call to ``peer`` was sent again on a fresh connection (its first write failed)."""
        with self._lock:
            self._counters(peer)[_RESENT] += 1

    def answered(self, peer: int, nbytes: int, *, failed: bool) -> None:
        """A call to ``peer`` ended (``nbytes`` of answer received)."""
        with self._lock:
            counters = self._peers.get(peer) or self._counters(peer)
            counters[_IN] += nbytes
            if failed:
                counters[_FAILED] += 1

    def request(self, peer: int, nbytes: int) -> None:
        """A request from ``peer`` arrived."""
        with self._lock:
            (self._peers.get(peer) or self._counters(peer))[_IN] += nbytes

    def refused(self, peer: int) -> None:
        """A message from ``peer`` was refused by the allow-list."""
        with self._lock:
            self._counters(peer)[_REFUSED] += 1

    def replied(self, peer: int, nbytes: int, *, failed: bool) -> None:
        """A request from ``peer`` was answered."""
        with self._lock:
            counters = self._peers.get(peer) or self._counters(peer)
            counters[_SERVED] += 1
            counters[_OUT] += nbytes
            if failed:
                counters[_SERVE_FAILED] += 1

    def peers(self, name_of: Mapping[int, str]) -> dict[str, PeerStatistics]:
        """The counters by peer name (rank where the name is unknown)."""
        with self._lock:
            snapshot = {rank: list(c) for rank, c in self._peers.items()}
        return {
            name_of.get(rank, str(rank)): PeerStatistics(
                calls_sent=c[_SENT],
                calls_failed=c[_FAILED],
                calls_resent=c[_RESENT],
                requests_served=c[_SERVED],
                requests_failed=c[_SERVE_FAILED],
                requests_refused=c[_REFUSED],
                bytes_sent=c[_OUT],
                bytes_received=c[_IN],
            )
            for rank, c in sorted(snapshot.items())
        }
