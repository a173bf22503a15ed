"""The parts of a pass's state on one worker: its sources (where torch's engine starts) and
its recv functions (where gradients leave), what it sends them, and the answers its driving
thread gets."""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd.graph import GradientEdge

from ._functions import RecvRecord
from ._grad_messages import GradUpdate
from ._plan import add_grads

__all__ = ["Answer", "Outbox", "RecvState", "Source", "edges"]


class Answer:
    """For the driving thread: the answer to one of its first messages."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException | None) -> None:
        self.error = error


class Source:
    """Where torch's engine starts on this worker: the roots, or a send function. Its
    gradients are summed until it is *resolved* (its final message and every gradient message
    it announced are in); only then does it start a run."""

    __slots__ = (
        "accumulators",
        "blocks",
        "expected",
        "final_seen",
        "grads",
        "key",
        "leaves",
        "processed",
        "recvs",
        "resolved",
        "roots",
        "shared",
    )

    def __init__(self, key: int) -> None:
        self.key = key
        self.leaves: dict[int, torch.Tensor] = {}
        self.accumulators: dict[int, Any] = {}  # the leaves' AccumulateGrad nodes
        self.recvs: set[int] = set()
        #: it shares nodes with another source: its runs go through a plan (``_plan``)
        self.shared = False
        #: the ids of the shared nodes it reaches (they are blocked while it is pending)
        self.blocks: list[int] = []
        self.resolved = False
        self.final_seen = False
        self.expected = 0
        self.processed = 0
        self.roots: tuple[Any, ...] = ()
        self.grads: list[torch.Tensor] | None = None

    def add(self, grads: list[torch.Tensor]) -> None:
        old = self.grads
        if old is None:
            self.grads = grads
        else:
            self.grads = [add_grads(a, b) for a, b in zip(old, grads, strict=True)]

    def take(self) -> list[torch.Tensor]:
        """The summed gradients, handed over: the list they came in (the message's) is
        emptied, so that the run's list is the only reference to them (see ``_execute``)."""
        grads = self.grads
        assert grads is not None
        self.grads = None
        taken = list(grads)
        grads.clear()
        return taken


class RecvState:
    __slots__ = ("final", "record", "sent", "sources")

    def __init__(self, record: RecvRecord) -> None:
        self.record = record
        self.sources: set[int] = set()
        self.sent = 0
        self.final = False


def edges(roots: tuple[Any, ...]) -> list[GradientEdge]:
    """A source's roots as gradient edges (the roots' tensors by their ``grad_fn``)."""
    return [
        root if isinstance(root, GradientEdge) else GradientEdge(root.grad_fn, root.output_nr)
        for root in roots
    ]


class Outbox:
    """The gradient updates a step of a pass queued for its peers, by peer and device map: one
    message each (the map travels with the message, so updates under different maps do not
    share one)."""

    __slots__ = ("_maps", "_updates")

    def __init__(self) -> None:
        self._updates: dict[tuple[int, int], list[GradUpdate]] = {}
        self._maps: dict[tuple[int, int], Any] = {}

    def __bool__(self) -> bool:
        return bool(self._updates)

    def add(self, worker: int, device_map: Any, update: GradUpdate) -> None:
        key = (worker, id(device_map) if device_map else 0)
        updates = self._updates.get(key)
        if updates is None:
            updates = self._updates[key] = []
            self._maps[key] = device_map or None
        updates.append(update)

    def pop(self, worker: int) -> tuple[GradUpdate, ...] | None:
        """The updates for ``worker`` with no device map, taken out."""
        updates = self._updates.pop((worker, 0), None)
        if updates is None:
            return None
        del self._maps[(worker, 0)]
        return tuple(updates)

    def take(self) -> list[tuple[int, Any, tuple[GradUpdate, ...]]]:
        """Everything queued, as ``(worker, device_map, updates)``; the outbox is then empty."""
        taken = [(key[0], self._maps[key], tuple(u)) for key, u in self._updates.items()]
        self._updates = {}
        self._maps = {}
        return taken
