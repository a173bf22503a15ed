"""Clock offsets between workers, estimated from profiled calls (NTP's method).

Each profiled call gives four timestamps: the caller sends at ``t0`` and has the response at
``t3`` (caller's clock); the callee starts handling at ``t1`` and ends at ``t2`` (its clock).
If the network delay is the same both ways, the callee's clock is ahead by

    offset = ((t1 - t0) + (t2 - t3)) / 2

with an error of at most half the round trip ``(t3 - t0) - (t2 - t1)``. As NTP's clock
filter does, the estimate kept per peer is the one from the sample with the smallest round
trip (the least room for asymmetry); the estimate is refreshed after a while so that drift
does not accumulate.

Mapping the callee's events with the best estimate may, for one unlucky call, place its
handling slightly outside the caller's range; the mapping then falls back to that call's own
sample, which by construction places ``[t1, t2]`` inside ``[t0, t3]``.
"""

from __future__ import annotations

import threading
import time

__all__ = ["OFFSETS", "ClockOffsets"]

_REFRESH_NS = 10 * 1_000_000_000  # a best sample older than this is replaced by a new one


class ClockOffsets:
    """Per-peer clock offset estimates of this worker (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._best: dict[int, tuple[int, int, int]] = {}  # peer -> (rtt, offset, taken at)

    def observe(self, peer: int, t0: int, t1: int, t2: int, t3: int) -> int:
        """Record one call's timestamps; return the offset to map this call's remote times
        onto the local clock (``local = remote - offset``)."""
        rtt = max(0, (t3 - t0) - (t2 - t1))
        sample = ((t1 - t0) + (t2 - t3)) // 2
        now = time.monotonic_ns()
        with self._lock:
            best = self._best.get(peer)
            if best is None or rtt <= best[0] or now - best[2] > _REFRESH_NS:
                best = self._best[peer] = (rtt, sample, now)
        offset = best[1]
        if t1 - offset < t0 or t2 - offset > t3:
            return sample
        return offset

    def offset(self, peer: int) -> int | None:
        """The current estimate for ``peer`` (ns; callee clock minus local clock)."""
        with self._lock:
            best = self._best.get(peer)
        return None if best is None else best[1]

    def snapshot(self) -> dict[int, tuple[int, int]]:
        """``{peer: (offset ns, round trip ns of the sample it came from)}``."""
        with self._lock:
            return {peer: (b[1], b[0]) for peer, b in self._best.items()}


OFFSETS = ClockOffsets()
