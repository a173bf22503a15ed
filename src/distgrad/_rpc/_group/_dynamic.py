"""Dynamic groups (``init_rpc(name, rank=r, world_size=None)``): members join and leave.

As torch's: the *leader* (rank 0) starts first and holds the store (a ``TCPStore`` made from the
``tcp://`` or ``env://`` init method, unless ``TORCHELASTIC_USE_AGENT_STORE`` says it lives
outside the members; with ``file://`` every member opens the same file store); every other
member joins by rendezvous with it. A join or a leave holds the group's *membership token*, a
lease on the membership state in the store (``_lease``), so they happen one at a time:

* **join**: take the token (completing the change of a holder that lost it), write the intent,
  tell each member (an RPC it answers once it knows the joiner; a member frozen or cut off is
  asked again until it answers, is proved dead, or ``rpc_timeout`` passes), commit. When
  ``init_rpc`` returns, every member can call the joiner and the joiner every member.
* **leave** (a graceful ``rpc.shutdown()``): this worker's calls finish and its RRef users are
  deleted, then each member is told (so later calls to it fail at once, naming it as departed),
  then the connections close with a goodbye.

A name may rejoin: the new agent start has a new incarnation, and the members take its previous
one for dead (``docs/failure-semantics.md``). The store serves joins and leaves only: members
already connected call each other without it, so losing the store's host stops joins and leaves
(which then fail, naming the store) but no call between members.
"""

from __future__ import annotations

import logging
import os
import time
from datetime import timedelta
from typing import Any

from ... import _config
from ..._devices._maps import plan_devices
from ..._errors import DistgradError, RpcShutdownError
from ..._transport._base import PeerAddress
from .._core import AgentState, RpcAgent, TensorPipeRpcBackendOptions, WorkerInfo, current_agent
from . import _rendezvous
from ._lease import LeaseLostError, MembershipLease

__all__ = ["join_group", "leave_group", "open_dynamic_store"]

_log = logging.getLogger("distgrad.rpc")


def open_dynamic_store(
    options: TensorPipeRpcBackendOptions, rank: int, timeout: timedelta
) -> tuple[Any, int]:
    """The group's store (rank 0 hosts a TCP one), as torch's ``_create_store_from_options``, and
    this worker's rank (from ``$RANK`` with ``env://`` and no rank given). Without a rank,
    torch's errors ("rank parameter missing", "environment variable RANK expected")."""
    from torch.distributed.rendezvous import _create_store_from_options

    store = _create_store_from_options(options, rank)  # type: ignore[no-untyped-call]
    store.set_timeout(timeout)
    if rank < 0:
        rank = int(os.environ["RANK"])
    _rendezvous.claim_group_kind(store, "dynamic")
    return store, rank


def lease_for(agent: RpcAgent, store: Any, record: dict[str, Any]) -> MembershipLease:
    """This worker's lease on the membership token: its holder renews it every heartbeat
    interval and loses it after twice the peer timeout without renewing (8 s by default)."""
    opts = agent.options
    bound = 2 * opts.peer_timeout
    return MembershipLease(
        store, record, agent.worker_info.id, bound, min(opts.heartbeat_interval, bound / 4)
    )


def join_group(
    agent: RpcAgent,
    store: Any,
    address: PeerAddress,
    explicit_secret: bool,
    timeout: float,
) -> list[WorkerInfo]:
    """Join the group through ``store``; return the members found (this worker not counted).
    Raises ``RuntimeError`` for a name or rank taken by another member, or a secret set on
    some members only; :class:`LeaseLostError` if this worker stalled past the lease's bound
    while joining (the next holder undoes its join)."""
    me = agent.worker_info
    record = _rendezvous.address_record(me, address, explicit_secret, agent.device_record())
    lease = lease_for(agent, store, record)
    state = lease.acquire(timeout)
    try:
        members = state.members
        if state.intent is not None:
            members = _complete(agent, lease, members, state.intent, timeout)
        for rank, rec in members.items():
            name = str(rec["name"])
            if name == me.name and rank != me.id:
                raise RuntimeError(
                    f"RPC worker name {name} is not unique. Workers {rank} and {me.id} share "
                    "the same name."
                )
            if rank == me.id and name != me.name:
                raise RuntimeError(f"RPC rank {rank} is used by worker {name} of the group")
        records = {rank: rec for rank, rec in members.items() if rank != me.id}
        with_secret = sorted(r for r, rec in records.items() if rec.get("explicit_secret"))
        if records and bool(with_secret) != explicit_secret:
            raise RuntimeError(
                "the cluster secret is set on "
                + ("this worker but not on the group" if explicit_secret else "the group")
                + " (TensorPipeRpcBackendOptions(secret=...) or $DISTGRAD_SECRET): set the same "
                "secret on every member, or on none"
            )
        # the joiner validates everyone's device maps (torch's checks; names are not checked:
        # a target may join later) before the group hears of it
        plan = plan_devices(
            me.name,
            [me.name, *(str(rec["name"]) for rec in records.values())],
            {
                me.name: record["devices"],
                **{str(rec["name"]): rec.get("devices") for rec in records.values()},
            },
            is_static_group=False,
        )
        agent.set_device_plan(plan)
        lease.commit(members, {"kind": "join", "rank": me.id, "record": record})
        workers = [WorkerInfo(str(rec["name"]), rank) for rank, rec in records.items()]
        addresses = {rank: _rendezvous.address_from_record(rec) for rank, rec in records.items()}
        addresses[me.id] = address
        joined = announce_join(agent, workers, addresses, record, timeout, lease)
        kept = {info.id: records[info.id] for info in joined}
        lease.commit({**kept, me.id: record}, None)
    finally:
        lease.release()
    return joined


def _complete(
    agent: RpcAgent,
    lease: MembershipLease,
    members: dict[int, dict[str, Any]],
    intent: dict[str, Any],
    timeout: float,
) -> dict[int, dict[str, Any]]:
    """Finish the change of a holder that lost the token (it died, or stalled past the bound):
    its leave is rolled forward, its join rolled back. Either way the worker of the intent is
    no member: every member is told it is gone (each incarnation of its rank the members may
    know), and the state is committed without it and without the intent."""
    me = agent.worker_info
    rank = int(intent["rank"])
    record = intent["record"]
    gone = {int(record.get("incarnation") or 0)}
    if rank in members:
        gone.add(int(members[rank].get("incarnation") or 0))
    reason = (
        "it shut down"
        if intent["kind"] == "leave"
        else f"it died or stalled while joining (the membership token was taken over: "
        f"{lease.bound:g}s without renewal)"
    )
    _log.warning(
        "completing the %s of %s (rank %d): %s", intent["kind"], record["name"], rank, reason
    )
    others = {r: rec for r, rec in members.items() if r not in (rank, me.id)}
    if agent.state is not AgentState.RUNNING:  # a joiner: it meets the members first
        workers = [WorkerInfo(str(rec["name"]), r) for r, rec in others.items()]
        addresses = {r: _rendezvous.address_from_record(rec) for r, rec in others.items()}
        assert agent.address is not None
        addresses[me.id] = agent.address
        agent.set_peers([me, *workers], addresses)
    infos = [WorkerInfo(str(rec["name"]), r) for r, rec in others.items()]
    answered = infos
    for incarnation in sorted(gone):
        answered = _tell(agent, answered, _member_left, (rank, incarnation, reason), timeout, lease)
    kept = {info.id: others[info.id] for info in answered}
    if me.id in members:
        kept[me.id] = members[me.id]
    lease.commit(kept, None)
    return kept


def _tell(
    agent: RpcAgent,
    infos: list[WorkerInfo],
    fn: Any,
    args: tuple[Any, ...],
    timeout: float,
    lease: MembershipLease | None,
) -> list[WorkerInfo]:
    """Call ``fn(*args)`` on each member of ``infos``; return those that answered. A member
    that fails to answer is asked again until it does, is proved dead, or ``timeout`` passes
    (a member frozen or cut off for a while is waited for, not given up); those that never
    answer are no members any more: the others are told so, and they are dropped here."""
    answered: list[WorkerInfo] = []
    dropped: list[WorkerInfo] = []
    deadline = time.monotonic() + (timeout if timeout > 0 else _config.DEFAULT_RPC_TIMEOUT_SEC)
    for info in infos:
        while True:
            if lease is not None:
                lease.check()
            left = deadline - time.monotonic()
            try:
                agent.call_sync(info, fn, args, {}, max(left, 0.1))
                answered.append(info)
                break
            except RpcShutdownError:
                raise
            except DistgradError as exc:
                if agent.peer_is_dead(info.id) or left <= _RETRY_S:
                    _log.warning("%s does not answer: no member any more (%s)", info.name, exc)
                    dropped.append(info)
                    break
                _log.info("%s did not answer (%s): asking again", info.name, exc)
                time.sleep(_RETRY_S)
    for info in dropped:
        incarnation = agent.incarnation_of(info.id)
        agent.remove_member(info.id, 0, "it did not answer the group")
        reason = f"it did not answer {agent.worker_info.name}"
        for other in answered:
            try:
                agent.call_sync(other, _member_left, (info.id, incarnation, reason), {}, 5.0)
            except DistgradError as exc:  # it learns of the loss by itself
                _log.info("%s was not told that %s is gone: %s", other.name, info.name, exc)
    return answered


_RETRY_S = 0.5


def announce_join(
    agent: RpcAgent,
    workers: list[WorkerInfo],
    addresses: dict[int, PeerAddress],
    record: dict[str, Any],
    timeout: float,
    lease: MembershipLease | None = None,
) -> list[WorkerInfo]:
    """Know the members (``workers`` at ``addresses``, this worker's own included) and tell
    each that this worker joined; return those that answered (one that never does is no member
    any more: see :func:`_tell`)."""
    me = agent.worker_info
    agent.set_peers([me, *workers], addresses)
    return _tell(agent, workers, _member_joined, (me.name, me.id, record), timeout, lease)


def leave_group(agent: RpcAgent, store: Any, timeout: float) -> None:
    """Tell every member this worker leaves (the caller then stops the agent). Without the
    store (the leader is gone) the members are told all the same."""
    me = agent.worker_info

    def tell() -> None:
        for info in agent.get_worker_infos():
            if info.id == me.id:
                continue
            try:
                agent.call_sync(info, _member_left, (me.id, agent.incarnation), {}, timeout)
            except DistgradError as exc:
                _log.info("%s was not told that %s leaves: %s", info.name, me.name, exc)

    if store is None:
        tell()
        return
    assert agent.address is not None
    record = _rendezvous.address_record(me, agent.address, False)
    lease = lease_for(agent, store, record)
    try:
        state = lease.acquire(timeout)
    except Exception as exc:  # the store is gone (the leader left or died)
        _log.warning("leaving without the group's store: %s", exc)
        tell()
        return
    try:
        members = state.members
        if state.intent is not None:
            members = _complete(agent, lease, members, state.intent, timeout)
        lease.commit(members, {"kind": "leave", "rank": me.id, "record": record})
        tell()
        members.pop(me.id, None)
        lease.commit(members, None)
    except LeaseLostError as exc:
        _log.warning("leaving: %s", exc)
    finally:
        lease.release()


def _member_joined(name: str, rank: int, record: dict[str, Any]) -> None:
    """On each member: ``name`` joined (runs as an RPC from the joiner)."""
    agent = current_agent()
    if agent is not None:
        agent.add_member(WorkerInfo(name, rank), _rendezvous.address_from_record(record))
        agent.device_member_joined(name, record.get("devices"))


def _member_left(rank: int, incarnation: int, reason: str = "it shut down") -> None:
    """On each member: the member of ``rank`` leaves (an RPC from it), or is gone (``reason``:
    from the member that found it so)."""
    agent = current_agent()
    if agent is not None:
        agent.remove_member(rank, incarnation, reason)
