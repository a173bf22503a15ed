"""Membership events of a dynamic group (what :func:`distgrad.rpc.add_membership_listener`
callbacks and :func:`distgrad.rpc.membership_events` receive)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ._worker_info import WorkerInfo

__all__ = ["MembershipEvent", "MembershipKind"]

#: ``joined``: a member joined (or rejoined: a new incarnation); ``left``: it left gracefully
#: (``rpc.shutdown()``); ``restarted``: a new incarnation of it replaced one that had not left
MembershipKind = Literal["joined", "left", "restarted"]


@dataclass(frozen=True)
class MembershipEvent:
    """One change of the group, as this worker saw it."""

    kind: MembershipKind
    worker: WorkerInfo
    #: the random id of the member's agent start this event is about
    incarnation: int
    #: when this worker learned of it (``time.time()``)
    time: float

    def __str__(self) -> str:
        return f"{self.worker.name} (rank {self.worker.id}) {self.kind}"
