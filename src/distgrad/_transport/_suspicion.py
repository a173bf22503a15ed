"""What a transport believes of each peer, and when it may judge one: the suspicion logic the
socket transport (``_transport``, ``_dialing``) and the in-memory one (``_inmemory``) share.

A peer is, as far as one transport knows (:class:`PeerVerdicts`):

* **alive**: nothing is held against it;
* **suspected**: its last connection was lost without proof -- no goodbye, silence past
  ``peer_timeout``, a reset. The transport tells the agent (what waited on that connection
  fails), but the next send connects again, and a peer that answers a fresh connection is no
  longer suspected (:meth:`PeerVerdicts.answered`);
* **unreachable for a moment**: a reconnect to a suspected peer failed without proof (a
  timeout, a frozen process whose kernel still accepts): calls in the next ``RETRY_AFTER``
  seconds fail at once with that error instead of each waiting for the same connect;
* **dead**, on proof only: its goodbye (it shut down), a refused connection (nothing listens at
  its address any more), its departure from a dynamic group, a severed link (fault injection),
  or -- with ``fail_stop`` -- any loss at all (torch's behaviour). Every later send to it fails
  at once.

A connection closed for a protocol error (a malformed or oversized frame) condemns that
connection only: the peer is not even suspected.

**Incarnations.** Every agent start has a random id, presented in the handshake. An id other
than the one known for a rank is a new incarnation: the old one is retired (its connections are
closed by the transport, naming the restart; it is never accepted again) and the new one starts
with a clean slate.

**Silence** is judged by the heartbeat tick (:class:`HeartbeatJudge`). A tick far behind its
time means this process was not running (SIGSTOP, a C call holding the GIL, a stalled host):
what its peers sent meanwhile still waits unread, and their silence is this process's own. Such
a tick judges no one (it only sends); the next one does -- never two in a row skip, so a dead
peer is still found one interval later at most.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping

from .._errors import PeerFailureError
from ._base import TransportConfig

__all__ = ["RETRY_AFTER", "STALL", "HeartbeatJudge", "PeerVerdicts"]

#: After a reconnect to a suspected peer failed without proof, calls within this long fail at once
RETRY_AFTER = 0.5
#: A heartbeat tick later than this (and than one interval) means this process stalled
STALL = 0.5


class PeerVerdicts:
    """One transport's verdicts on its peers, and the incarnation known for each. Thread-safe:
    reads take no lock (one dict lookup), compound updates take one."""

    def __init__(self, label: Callable[[int], str], *, fail_stop: bool) -> None:
        self._label = label
        self.fail_stop = fail_stop
        self._lock = threading.Lock()
        self._dead: dict[int, PeerFailureError] = {}
        #: the ranks known dead (the same dict: read on every send, see :meth:`is_dead`)
        self.dead: Mapping[int, PeerFailureError] = self._dead
        self._suspected: dict[int, PeerFailureError] = {}
        self._unreachable: dict[int, tuple[float, PeerFailureError]] = {}
        #: the incarnation known for each rank (read on every frame: see :meth:`is_current`)
        self.incarnations: dict[int, int] = {}
        self._retired: set[tuple[int, int]] = set()
        #: verdicts given, counted by (rank, kind, cause): ``suspected`` (``link_lost``),
        #: ``dead`` (``goodbye``, ``refused``, ``fail_stop``, ``severed``, ``left``, ``proof``),
        #: ``recovered`` (a suspected peer answered), ``restarted`` (a new incarnation)
        self._events: dict[tuple[int, str, str], int] = {}

    # -- reading -------------------------------------------------------------------------------
    def is_dead(self, rank: int) -> bool:
        return rank in self._dead

    def is_suspected(self, rank: int) -> bool:
        return rank in self._suspected

    def dead_peers(self) -> tuple[int, ...]:
        return tuple(sorted(self._dead))

    def event_counts(self) -> tuple[tuple[int, str, str, int], ...]:
        """The verdicts given so far: ``(rank, kind, cause, count)``."""
        with self._lock:
            return tuple((*key, n) for key, n in sorted(self._events.items()))

    def _count(self, rank: int, kind: str, cause: str) -> None:
        with self._lock:
            key = (rank, kind, cause)
            self._events[key] = self._events.get(key, 0) + 1

    def check_alive(self, rank: int) -> None:
        """Raise the peer's failure if it is dead, or if a reconnect to it failed a moment ago
        (a fresh copy each time: a raised error collects the frames it passes)."""
        dead = self._dead.get(rank)
        if dead is not None:
            raise PeerFailureError(str(dead), dead.peer)
        unreachable = self._unreachable.get(rank)
        if unreachable is not None and time.monotonic() < unreachable[0]:
            raise PeerFailureError(str(unreachable[1]), unreachable[1].peer)

    # -- proof and suspicion ---------------------------------------------------------------------
    def prove_dead(self, rank: int, error: PeerFailureError, cause: str = "proof") -> None:
        """Proof that ``rank`` is gone (a refused connect, a severed link); the first proof's
        error is kept."""
        if rank not in self._dead:
            self._count(rank, "dead", cause)
        self._dead.setdefault(rank, error)

    def departed(self, rank: int, error: Exception) -> None:
        """``rank`` left the group (a dynamic group's graceful departure)."""
        if not isinstance(error, PeerFailureError):
            error = PeerFailureError(str(error), self._label(rank))
        if rank not in self._dead:
            self._count(rank, "dead", "left")
        with self._lock:
            self._dead[rank] = error
            self._suspected.pop(rank, None)
            self._unreachable.pop(rank, None)

    def joined(self, rank: int) -> None:
        """A member joined under ``rank`` (a dynamic group's join of a current incarnation):
        it is reachable, whatever was said of the rank before -- the removal of its previous
        incarnation may arrive after the new one's handshake."""
        with self._lock:
            self._dead.pop(rank, None)
            self._suspected.pop(rank, None)
            self._unreachable.pop(rank, None)

    def link_lost(
        self,
        rank: int,
        failure: PeerFailureError,
        *,
        protocol_error: bool,
        goodbye: bool,
        nobody_listens: bool,
        superseded: bool,
    ) -> bool:
        """A connection to ``rank`` closed. ``goodbye``: it said goodbye first;
        ``nobody_listens``: its address refuses connections now (where the transport can tell
        without connecting); ``superseded``: a newer connection to it exists (it answered
        since). Records the verdict; returns whether what waited on the peer fails (always,
        except for a protocol error, which condemns the connection only)."""
        if protocol_error:
            return False
        if goodbye or self.fail_stop or nobody_listens:
            cause = "goodbye" if goodbye else "refused" if nobody_listens else "fail_stop"
            self.prove_dead(rank, failure, cause)
        elif not superseded:
            if rank not in self._suspected:
                self._count(rank, "suspected", "link_lost")
            self._suspected[rank] = failure
        return True

    def reconnect_failed(self, rank: int, error: PeerFailureError) -> None:
        """A connect to ``rank`` failed without proof: if it is suspected, calls in the next
        moment fail at once with ``error``."""
        if rank in self._suspected:
            self._unreachable[rank] = (time.monotonic() + RETRY_AFTER, error)

    def answered(self, rank: int) -> None:
        """``rank`` answered a fresh connection: it is back."""
        if self._suspected.pop(rank, None) is not None:
            self._count(rank, "recovered", "answered")
        self._unreachable.pop(rank, None)

    # -- incarnations --------------------------------------------------------------------------
    def know_incarnation(self, rank: int, incarnation: int) -> None:
        """The incarnation published for ``rank`` by the rendezvous (unless one is known)."""
        if incarnation:
            self.incarnations.setdefault(rank, incarnation)

    def note_incarnation(self, rank: int, incarnation: int) -> tuple[bool, PeerFailureError | None]:
        """A peer of ``rank`` presented ``incarnation``. Returns ``(accepted, restarted)``:
        ``accepted`` is False for an incarnation that was replaced (its connection must be
        dropped); ``restarted`` is the error naming the restart when this one replaces the
        incarnation known so far (the transport closes the old one's connections with it)."""
        if not incarnation:
            return True, None
        with self._lock:
            if (rank, incarnation) in self._retired:
                return False, None
            known = self.incarnations.get(rank)
            self.incarnations[rank] = incarnation
            if known is None or known == incarnation:
                return True, None
            self._retired.add((rank, known))
            key = (rank, "restarted", "incarnation")
            self._events[key] = self._events.get(key, 0) + 1
            self._dead.pop(rank, None)
            self._suspected.pop(rank, None)
            self._unreachable.pop(rank, None)
        label = self._label(rank)
        return True, PeerFailureError(
            f"{label} restarted: its incarnation {known:016x} was replaced by {incarnation:016x}; "
            "what depended on the old one (calls in flight, RRefs it owned, contexts it took "
            "part in) is lost",
            label,
        )

    def is_current(self, rank: int, incarnation: int) -> bool:
        """Whether a connection of ``rank``'s ``incarnation`` (0: unknown) belongs to the
        incarnation known now."""
        return not incarnation or self.incarnations.get(rank) in (None, incarnation)

    def is_retired(self, rank: int, incarnation: int) -> bool:
        """Whether ``incarnation`` of ``rank`` was replaced."""
        return (rank, incarnation) in self._retired


class HeartbeatJudge:
    """When a transport's heartbeat tick may judge its peers' silence, and the verdict on one
    connection. Used on the I/O thread only."""

    def __init__(self, config: TransportConfig) -> None:
        self.interval = config.heartbeat_interval
        self.peer_timeout = config.peer_timeout
        #: ticks that found this process had not been running
        self.stalls = 0
        self._due = 0.0
        self._skipped = False

    def scheduled(self, now: float) -> float:
        """The next tick is scheduled now: the delay to use (one interval)."""
        self._due = now + self.interval
        return self.interval

    def tick(self, now: float) -> bool:
        """A tick runs: whether it may judge (it was not late, or the previous one skipped)."""
        late = now - self._due
        judge = late < max(self.interval, STALL) or self._skipped
        self._skipped = not judge
        if not judge:
            self.stalls += 1
        return judge

    def silent(self, label: str, last_recv: float, now: float) -> PeerFailureError | None:
        """The error to close a connection with if its peer has been silent too long."""
        silent = now - last_recv
        if silent <= self.peer_timeout:
            return None
        return PeerFailureError(
            f"{label} sent nothing for {silent:.1f}s (peer timeout {self.peer_timeout:g}s); it "
            "is suspected: what waited on it fails, a later call connects again",
            label,
        )

    def wants_heartbeat(self, last_send: float, now: float) -> bool:
        """Whether a connection idle since ``last_send`` should carry a heartbeat now."""
        return now - last_send >= self.interval * 0.5
