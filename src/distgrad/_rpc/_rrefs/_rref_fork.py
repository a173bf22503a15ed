"""Sending an RRef through RPC forks it: the sender's side (``_reduce_rref``, the reference's
``prepareChildFork``) and the receiver's (``_rebuild_rref``); ``_rref_context`` explains the
tables they update. ``_layer.register`` installs ``_reduce_rref`` as the RRef's reducer in RPC
pickling (this module is above ``_rref``: it builds RRefs)."""

from __future__ import annotations

from typing import Any

import torch

from .._core import delivery as _delivery
from ._rref import RRef, SerializedRRef
from ._rref_context import GloballyUniqueId, context_of
from ._rref_owner import _agent_or_raise

# -- pickling through RPC (forks) --------------------------------------------------------------
ForkData = tuple[int, GloballyUniqueId, GloballyUniqueId, int, bool]


def _reduce_rref(rref: RRef[Any]) -> tuple[Any, ForkData]:
    """Sender side of a fork (the reference's ``prepareChildFork``)."""
    ctx = rref._ctx
    if ctx.destroyed:
        raise RuntimeError(f"{rref} belongs to an RPC agent that was shut down")
    if rref._deleted:
        raise RuntimeError(f"{rref} has been deleted. Cannot call fork an UserRRef after deletion.")
    rref._check_usable()
    fork_id = ctx.new_id()
    if rref._value is not None:  # the owner: register the fork at once
        ctx.keep_owner(rref._rref_id, rref._value)
        ctx.add_fork(rref._rref_id, fork_id)
    else:  # a user: stay alive until the owner knows the child
        ctx.add_pending_child(fork_id, rref, _delivery.destination())
        # (if the request carrying it fails, the child is settled: see RRefContext.child_failed)
        _delivery.on_failure(lambda maybe_delivered: ctx.child_failed(fork_id, maybe_delivered))
    return _rebuild_rref, (rref._owner.id, rref._rref_id, fork_id, ctx.worker_id, rref._script)


def _rebuild_rref(
    owner: int,
    rref_id: GloballyUniqueId,
    fork_id: GloballyUniqueId,
    parent: int,
    script: bool = False,
) -> RRef[Any]:
    """Receiver side of a fork."""
    agent = _agent_or_raise()
    ctx = context_of(agent)
    if owner == ctx.worker_id:  # back at the owner: the one OwnerRRef
        rref: RRef[Any] = RRef._new_owner(ctx, rref_id, ctx.get_or_create_owner(rref_id))
        if parent == owner:  # sent to itself: the fork registered when pickling is not a user
            ctx.del_forks([(rref_id, fork_id)])
        else:  # no user holds this fork id; its parent may let go
            ctx.accept_child(parent, fork_id)
        return rref
    rref = RRef._new_user(ctx, rref_id, fork_id, agent.get_worker_info(owner))
    rref._script = script
    if parent == owner:  # the owner registered the fork before sending it
        rref._settle(None)
        ctx.add_confirmed_user(rref)
    else:
        ctx.request_fork(rref, parent)
        ctx.collect(rref)
    return rref


# -- by hand: torch's PyRRef._serialize / _deserialize -------------------------------------------


def serialize_rref(rref: RRef[Any]) -> SerializedRRef:
    """``RRef._serialize``: fork ``rref`` as :func:`_reduce_rref` does, as torch's tuple."""
    _, (owner, rref_id, fork_id, parent, script) = _reduce_rref(rref)
    value = rref._value
    tensor = value is not None and value.done() and isinstance(value._value, torch.Tensor)
    kind = "Tensor" if script or tensor else "PyObject"
    return (
        owner,
        rref_id.created_on,
        rref_id.local_id,
        fork_id.created_on,
        fork_id.local_id,
        parent,
        kind,
    )


def deserialize_rref(data: SerializedRRef) -> RRef[Any]:
    """``RRef._deserialize``: the receiver's side of :func:`serialize_rref`."""
    try:
        owner, rref_on, rref_local, fork_on, fork_local, parent, kind = data
        ids = [int(x) for x in (owner, rref_on, rref_local, fork_on, fork_local, parent)]
    except (TypeError, ValueError):
        raise ValueError(
            "RRef._deserialize expects the 7-tuple that RRef._serialize returns (owner id, "
            "RRef id created_on and local_id, fork id created_on and local_id, parent id, "
            f"type), got {data!r}"
        ) from None
    return _rebuild_rref(
        ids[0],
        GloballyUniqueId(ids[1], ids[2]),
        GloballyUniqueId(ids[3], ids[4]),
        ids[5],
        kind != "PyObject",
    )
