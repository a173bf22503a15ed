"""Dynamic groups (``init_rpc(name, rank=r, world_size=None)``): members join and leave.

As torch's: the *leader* (rank 0) starts first and holds the store (a ``TCPStore`` made from the
``tcp://`` or ``env://`` init method; with ``file://`` every member opens the same file store);
every other member joins by rendezvous with it. A join or
a leave holds the group's *membership token* in the store (torch's
``_group_membership_management``), so they happen one at a time:

* **join**: publish this worker's record (name, address, incarnation), read the members', and
  tell each member (an RPC it answers once it knows the joiner). When ``init_rpc`` returns,
  every member can call the joiner and the joiner every member.
* **leave** (a graceful ``rpc.shutdown()``): this worker's calls finish and its RRef users are
  deleted, then each member is told (so later calls to it fail at once, naming it as departed),
  then the connections close with a goodbye.

A name may rejoin: the new agent start has a new incarnation, and the members take its previous
one for dead (``docs/failure-semantics.md``). The store serves joins and leaves only: members
already connected call each other without it, so losing the leader stops joins and leaves
(which then fail, naming the store) but no call between members.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

from ..._devices._maps import plan_devices
from ..._errors import DistgradError
from ..._transport._base import PeerAddress
from .._core._agent import RpcAgent, current_agent
from .._core._options import TensorPipeRpcBackendOptions
from .._core._worker_info import WorkerInfo
from . import _rendezvous

__all__ = ["join_group", "leave_group", "open_dynamic_store"]

_log = logging.getLogger("distgrad.rpc")
_TOKEN = "distgrad/membership-token"
_MEMBERS = "distgrad/members"


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


@contextlib.contextmanager
def _membership_token(store: Any, name: str, timeout: float) -> Iterator[None]:
    """Hold the group's membership token (one join or leave at a time)."""
    deadline = time.monotonic() + (timeout if timeout > 0 else 3600.0 * 24 * 365)
    while True:
        holder = bytes(store.compare_set(_TOKEN, "", name)).decode()
        if holder == name:
            break
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"timed out after {timeout:g}s waiting for the group membership token, held by "
                f"{holder} (a worker that died while joining or leaving holds it for good)"
            )
        time.sleep(0.005)
    try:
        yield
    finally:
        try:
            store.compare_set(_TOKEN, name, "")
        except Exception as exc:  # the store is gone (the leader died): nothing to release
            _log.warning("could not release the group membership token: %s", exc)


def _read_members(store: Any) -> dict[int, str]:
    if not store.check([_MEMBERS]):
        return {}
    raw: dict[str, str] = json.loads(bytes(store.get(_MEMBERS)))
    return {int(rank): name for rank, name in raw.items()}


def _write_members(store: Any, members: dict[int, str]) -> None:
    store.set(_MEMBERS, json.dumps({str(r): n for r, n in sorted(members.items())}))


def join_group(
    agent: RpcAgent,
    store: Any,
    address: PeerAddress,
    explicit_secret: bool,
    timeout: float,
) -> list[WorkerInfo]:
    """Join the group through ``store``; return the members found (this worker not counted).
    Raises ``RuntimeError`` for a name or rank taken by another member, or a secret set on
    some members only."""
    me = agent.worker_info
    with _membership_token(store, me.name, timeout):
        members = _read_members(store)
        for rank, name in members.items():
            if name == me.name and rank != me.id:
                raise RuntimeError(
                    f"RPC worker name {name} is not unique. Workers {rank} and {me.id} share "
                    "the same name."
                )
            if rank == me.id and name != me.name:
                raise RuntimeError(f"RPC rank {rank} is used by worker {name} of the group")
        others = {rank: name for rank, name in members.items() if rank != me.id}
        records = {rank: json.loads(bytes(store.get(f"distgrad/worker/{rank}"))) for rank in others}
        with_secret = sorted(r for r, rec in records.items() if rec.get("explicit_secret"))
        if records and bool(with_secret) != explicit_secret:
            raise RuntimeError(
                "the cluster secret is set on "
                + ("this worker but not on the group" if explicit_secret else "the group")
                + " (TensorPipeRpcBackendOptions(secret=...) or $DISTGRAD_SECRET): set the same "
                "secret on every member, or on none"
            )
        devices = agent.device_record()
        plan = plan_devices(
            me.name,
            [me.name, *(str(rec["name"]) for rec in records.values())],
            {
                me.name: devices,
                **{str(rec["name"]): rec.get("devices") for rec in records.values()},
            },
            is_static_group=False,
        )
        agent.set_device_plan(plan)
        record = _rendezvous.address_record(me, address, explicit_secret, devices)
        store.set(f"distgrad/worker/{me.id}", json.dumps(record))
        workers = [WorkerInfo(str(rec["name"]), rank) for rank, rec in records.items()]
        addresses = {rank: _rendezvous.address_from_record(rec) for rank, rec in records.items()}
        addresses[me.id] = address
        joined = announce_join(agent, workers, addresses, record, timeout)
        for info in workers:
            if info not in joined:
                members.pop(info.id, None)
        members[me.id] = me.name
        try:
            _write_members(store, members)
        except Exception as exc:  # joined all the same: the members know this worker now
            _log.warning("joined, but the group's store is gone (the leader died?): %s", exc)
    return joined


def announce_join(
    agent: RpcAgent,
    workers: list[WorkerInfo],
    addresses: dict[int, PeerAddress],
    record: dict[str, Any],
    timeout: float,
) -> list[WorkerInfo]:
    """Know the members (``workers`` at ``addresses``, this worker's own included) and tell
    each that this worker joined; return those that answered (one that does not died without
    leaving, and is no member any more)."""
    me = agent.worker_info
    agent.set_peers([me, *workers], addresses)
    joined: list[WorkerInfo] = []
    for info in workers:
        try:
            agent.call_sync(info, _member_joined, (me.name, me.id, record), {}, timeout)
        except DistgradError as exc:
            _log.warning("%s did not answer the join of %s: %s", info.name, me.name, exc)
            agent.remove_member(info.id, 0, f"it did not answer the join of {me.name}")
            continue
        joined.append(info)
    return joined


def leave_group(agent: RpcAgent, store: Any, timeout: float) -> None:
    """Tell every member this worker leaves (the caller then stops the agent). Without the
    store (the leader is gone) the members are told all the same."""
    me = agent.worker_info
    others = [info for info in agent.get_worker_infos() if info.id != me.id]

    def tell() -> None:
        for info in others:
            try:
                agent.call_sync(info, _member_left, (me.id, agent.incarnation), {}, timeout)
            except DistgradError as exc:
                _log.info("%s was not told that %s leaves: %s", info.name, me.name, exc)

    if me.id == 0 or store is None:  # the leader (its store goes with it), or no store
        tell()
        return
    try:
        token = _membership_token(store, me.name, timeout)
        token.__enter__()
    except Exception as exc:  # the store is gone (the leader left or died)
        _log.warning("leaving without the group's store: %s", exc)
        tell()
        return
    try:
        members = _read_members(store)
        members.pop(me.id, None)
        _write_members(store, members)
        tell()
    finally:
        token.__exit__(None, None, None)


def _member_joined(name: str, rank: int, record: dict[str, Any]) -> None:
    """On each member: ``name`` joined (runs as an RPC from the joiner)."""
    agent = current_agent()
    if agent is not None:
        agent.add_member(WorkerInfo(name, rank), _rendezvous.address_from_record(record))
        agent.device_member_joined(name, record.get("devices"))


def _member_left(rank: int, incarnation: int) -> None:
    """On each member: the member of ``rank`` leaves (an RPC from it)."""
    agent = current_agent()
    if agent is not None:
        agent.remove_member(rank, incarnation)
