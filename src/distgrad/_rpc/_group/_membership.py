"""The membership API: who is in the group now, and being told when that changes.

Public in ``distgrad.rpc`` (torch has no such API; ``get_worker_infos()`` is its nearest)::

    rpc.init_rpc("trainer3", rank=3, world_size=None)   # a dynamic group
    rpc.members()                                        # [WorkerInfo(...), ...]
    rpc.add_membership_listener(lambda event: print(event))   # "trainer5 (rank 5) joined"

Listeners run on one of the agent's callback threads, once per event, in the order this worker
learned of them; they must not block for long. Works in static groups too (no events there).
"""

from __future__ import annotations

from collections.abc import Callable

from .._core import MembershipEvent, RpcAgent, WorkerInfo, current_agent

__all__ = ["add_membership_listener", "members", "remove_membership_listener"]

MembershipListener = Callable[[MembershipEvent], None]


def _agent() -> RpcAgent:
    agent = current_agent()
    if agent is None:
        raise RuntimeError(
            "RPC has not been initialized. Call torch.distributed.rpc.init_rpc first."
        )
    return agent


def members() -> list[WorkerInfo]:
    """The current members of this worker's group (itself included), by rank.

    Raises:
        RuntimeError: RPC is not initialized.
    """
    return _agent().members()


def add_membership_listener(listener: MembershipListener) -> None:
    """Call ``listener(event)`` for every later :class:`MembershipEvent` (a member joined, left,
    or was replaced by a new incarnation of itself), until it is removed or RPC shuts down.

    Args:
        listener: called with each event, on one of the agent's callback threads.

    Raises:
        RuntimeError: RPC is not initialized.
        TypeError: ``listener`` is not callable.
    """
    if not callable(listener):
        raise TypeError(f"a membership listener must be callable, got {listener!r}")
    _agent().membership_listeners.append(listener)


def remove_membership_listener(listener: MembershipListener) -> None:
    """Stop calling ``listener`` (added by :func:`add_membership_listener`).

    Args:
        listener: the callable given to :func:`add_membership_listener`.

    Raises:
        RuntimeError: RPC is not initialized.
        ValueError: ``listener`` was not added.
    """
    listeners = _agent().membership_listeners
    if listener not in listeners:
        raise ValueError(f"{listener!r} is not a membership listener")
    listeners.remove(listener)
