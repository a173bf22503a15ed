"""``WorkerInfo`` and worker-name validation."""

from __future__ import annotations

import re
from typing import Any

__all__ = ["WorkerInfo", "validate_worker_name"]

_NAME_RE = re.compile(r"^[A-Za-z0-9\-_:]*$")


def validate_worker_name(name: object) -> str:
    """Return ``name`` if it is a valid worker name, else raise the reference's error."""
    if not isinstance(name, str) or not name or len(name) >= 128 or not _NAME_RE.match(name):
        raise RuntimeError(
            "Worker name must match ^[A-Za-z0-9-_:]*$, and must be non-empty and shorter "
            f"than 128 chars, but got {name}"
        )
    return name


class WorkerInfo:
    """A worker's name and id (its rank), as torch's ``WorkerInfo``.

    Returned by ``rpc.get_worker_info`` and ``RRef.owner()``; usable as the destination of
    every call (it saves looking the name up). Equal when name and id are equal; hashes by
    id; picklable (it can travel in RPCs); prints as ``WorkerInfo(id=1, name=worker1)``.

    Args:
        name (str): the worker's name.
        id (int): the worker's id, its rank in the group.

    Attributes:
        name (str): the worker's name.
        id (int): the worker's id.

    Example:
        # on worker 0 (worker1 serves)
        peer = rpc.get_worker_info("worker1")
        peer.name, peer.id  # ("worker1", 1)
        rpc.rpc_sync(peer, torch.add, args=(torch.ones(2), 1))
    """

    __slots__ = ("id", "name")

    def __init__(self, name: str, id: int) -> None:
        # torch's checks: a name of the allowed characters, an id that fits its int16
        if not isinstance(name, str) or not isinstance(id, int) or not -32768 <= id < 32768:
            raise TypeError(
                "__init__(): incompatible constructor arguments. The following argument types "
                "are supported:\n    1. WorkerInfo(name: str, id: int)\n\n"
                f"Invoked with: {name!r}, {id!r}"
            )
        validate_worker_name(name)
        self.name = name
        self.id = id

    def __repr__(self) -> str:
        return f"WorkerInfo(id={self.id}, name={self.name})"

    __str__ = __repr__

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, WorkerInfo):
            return NotImplemented
        return self.id == other.id and self.name == other.name

    def __hash__(self) -> int:
        return hash(self.id)

    def __reduce__(self) -> tuple[Any, ...]:
        return (WorkerInfo, (self.name, self.id))
