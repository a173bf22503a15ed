"""What an agent has done: its lifecycle state (:class:`AgentState`) and its counters, per
peer, as an :class:`AgentStatistics` snapshot (``RpcAgent.agent_statistics()``)."""

from __future__ import annotations

import bisect
import enum
import threading
import time
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..._transport._base import TransportStatistics

__all__ = [
    "FUNCTION_LABELS",
    "LATENCY_BOUNDS",
    "OUTCOMES",
    "AgentState",
    "AgentStatistics",
    "FunctionStatistics",
    "PeerStatistics",
    "StatisticsRecorder",
    "function_label",
]

#: the upper bounds (seconds) of the latency histograms' buckets: 25 us * 2**i (25 us to about
#: 13 s), then everything longer; fixed, so that histograms of every member add up
LATENCY_BOUNDS: tuple[float, ...] = tuple(25e-6 * 2**i for i in range(20))
#: how a call ended: answered; timed out; the callee raised (an error reply); the peer failed
#: (the connection broke, the peer died or restarted, the request could not be sent); anything
#: else (the agent stopping, an encoding error after registration)
OUTCOMES = ("ok", "timeout", "remote", "peer_failure", "other")
OK, TIMEOUT, REMOTE, PEER_FAILURE, OTHER = range(5)
#: distinct function names kept per peer; calls of more are counted under ``(other)``
MAX_FUNCTIONS = 256


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
    #: calls sent to this peer and not ended yet
    calls_in_flight: int = 0
    #: requests from this peer arrived and not answered yet
    requests_in_flight: int = 0
    #: this worker's calls to the peer, by the function called
    functions: Mapping[str, FunctionStatistics] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class FunctionStatistics:
    """The calls of one function to one peer: how they ended and how long they took (from the
    request's registration to its answer, timeout or failure)."""

    #: by outcome (``OUTCOMES``: ok, timeout, remote, peer_failure, other)
    outcomes: Mapping[str, int]
    #: calls per latency bucket: ``buckets[i]`` took at most ``LATENCY_BOUNDS[i]`` seconds
    #: (and more than the bound before); the last one, longer than every bound
    buckets: tuple[int, ...]
    #: seconds, all calls together
    seconds: float

    @property
    def calls(self) -> int:
        return sum(self.outcomes.values())

    @property
    def errors(self) -> int:
        return self.calls - self.outcomes.get("ok", 0)

    def quantile(self, q: float) -> float:
        """The ``q`` quantile of the latency (seconds), as the upper bound of the bucket it
        falls in (the longest bound for the overflow bucket); 0 without calls."""
        total = sum(self.buckets)
        if not total:
            return 0.0
        rank = q * total
        seen = 0
        for i, count in enumerate(self.buckets):
            seen += count
            if seen >= rank and count:
                return LATENCY_BOUNDS[min(i, len(LATENCY_BOUNDS) - 1)]
        return LATENCY_BOUNDS[-1]


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
    #: membership events seen (``joined``, ``left``, ``restarted``), by kind
    membership: Mapping[str, int] = field(default_factory=dict)
    #: seconds since the agent was made
    uptime: float = 0.0
    #: the layers' figures (RRefs, distributed autograd): ``RpcLayer.metrics``
    layers: Mapping[str, float] = field(default_factory=dict)

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
_SENT, _FAILED, _SERVED, _SERVE_FAILED, _OUT, _IN, _RESENT, _REFUSED, _ENDED, _ARRIVED = range(10)
_COUNTERS = 10
# a function's entry: outcome counts, the seconds, then the buckets
_SECONDS = len(OUTCOMES)
_BUCKETS = _SECONDS + 1
_ENTRY = _BUCKETS + len(LATENCY_BOUNDS) + 1

#: function -> its label (bounded; the common functions of a job); ``Outgoing`` reads it inline
FUNCTION_LABELS: dict[Any, str] = {}


def function_label(func: Any) -> str:
    """The name a call of ``func`` is counted under (``module.qualname``), cached."""
    try:
        label = FUNCTION_LABELS.get(func)
    except TypeError:  # an unhashable callable
        return _name(func)
    if label is None:
        label = _name(func)
        if len(FUNCTION_LABELS) < 4096:
            FUNCTION_LABELS[func] = label
    return label


def _name(func: Any) -> str:
    qualname: Any
    if isinstance(func, types.BuiltinFunctionType):  # (torch.add: not _VariableFunctionsClass)
        qualname = func.__name__
    else:
        qualname = getattr(func, "__qualname__", None) or getattr(func, "__name__", None)
    if qualname is None:
        return type(func).__qualname__
    module = getattr(func, "__module__", None)
    return f"{module}.{qualname}" if module else str(qualname)


class StatisticsRecorder:
    """The agent's counters, per peer rank, and per peer and function its calls' outcomes and
    latency histograms; cheap to update from any thread (one short lock, no allocation once a
    peer's and a function's entries exist)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._peers: dict[int, list[int]] = {}
        self._functions: dict[int, dict[str, list[Any]]] = {}
        self._membership: dict[str, int] = {}
        self._started = time.monotonic()

    def __repr__(self) -> str:
        return f"StatisticsRecorder(peers={sorted(self._peers)})"

    @property
    def uptime(self) -> float:
        return time.monotonic() - self._started

    def _counters(self, peer: int) -> list[int]:
        """(Under the lock.) ``peer``'s counters, made on first use. The per-call methods
        inline its common case: ``self._peers.get(peer) or self._counters(peer)``."""
        counters = self._peers.get(peer)
        if counters is None:
            counters = self._peers.setdefault(peer, [0] * _COUNTERS)
        return counters

    def _entry(self, peer: int, function: str) -> list[Any]:
        """(Under the lock.) The entry of ``function`` to ``peer``, made on first use."""
        functions = self._functions.setdefault(peer, {})
        entry = functions.get(function)
        if entry is None:
            if len(functions) >= MAX_FUNCTIONS:
                function = "(other)"
                entry = functions.get(function)
            if entry is None:
                entry = functions[function] = [0] * _ENTRY
                entry[_SECONDS] = 0.0
        return entry

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

    def answered(
        self, peer: int, nbytes: int, function: str, seconds: float, outcome: int = OK
    ) -> None:
        """A call to ``peer`` ended (``nbytes`` of answer received) after ``seconds``, as
        ``outcome`` (an index into ``OUTCOMES``; anything but ``OK`` failed it), counted under
        ``function``. (Positional: it runs for every call.)"""
        bucket = _BUCKETS + bisect.bisect_left(LATENCY_BOUNDS, seconds)
        with self._lock:
            counters = self._peers.get(peer) or self._counters(peer)
            counters[_IN] += nbytes
            counters[_ENDED] += 1
            if outcome:
                counters[_FAILED] += 1
            functions = self._functions.get(peer)
            entry = functions.get(function) if functions is not None else None
            if entry is None:
                entry = self._entry(peer, function)
            entry[outcome] += 1
            entry[_SECONDS] += seconds
            entry[bucket] += 1

    def request(self, peer: int, nbytes: int) -> None:
        """A request from ``peer`` arrived."""
        with self._lock:
            counters = self._peers.get(peer) or self._counters(peer)
            counters[_IN] += nbytes
            counters[_ARRIVED] += 1

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

    def membership(self, kind: str) -> None:
        """A membership event (``joined``, ``left``, ``restarted``) was seen."""
        with self._lock:
            self._membership[kind] = self._membership.get(kind, 0) + 1

    def membership_counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._membership)

    def peers(self, name_of: Mapping[int, str]) -> dict[str, PeerStatistics]:
        """The counters by peer name (rank where the name is unknown)."""
        with self._lock:
            snapshot = {rank: list(c) for rank, c in self._peers.items()}
            functions = {
                rank: {name: list(entry) for name, entry in entries.items()}
                for rank, entries in self._functions.items()
            }
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
                calls_in_flight=max(0, c[_SENT] - c[_ENDED]),
                requests_in_flight=max(0, c[_ARRIVED] - c[_SERVED]),
                functions={
                    name: FunctionStatistics(
                        outcomes=dict(zip(OUTCOMES, entry[:_SECONDS], strict=True)),
                        buckets=tuple(entry[_BUCKETS:]),
                        seconds=float(entry[_SECONDS]),
                    )
                    for name, entry in sorted(functions.get(rank, {}).items())
                },
            )
            for rank, c in sorted(snapshot.items())
        }
