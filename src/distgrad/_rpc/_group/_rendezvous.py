"""Rendezvous: the store, the exchange of worker names and addresses, and the cluster secret.

The store is torch's own (``TCPStore`` for ``env://`` and ``tcp://``, ``FileStore`` for
``file://``), created by ``torch.distributed.rendezvous`` exactly as torch's RPC does. What
distgrad puts in it is plain JSON and hex text -- never a pickle.
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any
from urllib.parse import urlparse

import torch.distributed as dist

from ... import _config
from ..._devices._maps import DevicePlan, plan_devices
from ..._transport._transport import PeerAddress
from .._core import TensorPipeRpcBackendOptions, WorkerInfo
from ._addresses import listen_host_for

__all__ = [
    "ClusterSecret",
    "agree_secret",
    "barrier",
    "exchange_addresses",
    "listen_host",
    "open_store",
]

_FOREVER = timedelta(days=365)
_SECRET_KEY = "distgrad/secret"
#: rank 0 writes where its secret comes from: one of the two values below
_SECRET_SOURCE = "distgrad/secret-source"
_EXPLICIT = "explicit"
_GENERATED = "generated"


def store_timeout(rpc_timeout: float) -> timedelta:
    return timedelta(seconds=rpc_timeout) if rpc_timeout > 0 else _FOREVER


def open_store(
    init_method: str, rank: int, world_size: int | None, timeout: timedelta
) -> tuple[Any, int, int, Iterator[Any]]:
    """Rendezvous through ``init_method``; return the store, rank and world size.

    ``env://`` reads ``RANK`` and ``WORLD_SIZE`` from the environment when they are not given
    (as torchrun sets them). The iterator is returned so the caller keeps it alive.
    """
    if world_size is None:
        if init_method.startswith("env://") and os.environ.get("WORLD_SIZE"):
            world_size = -1
        else:
            raise RuntimeError(
                "a dynamic RPC group (world_size=None) is opened by init_rpc with a tcp:// or "
                "env:// init_method"
            )
    rendezvous = dist.rendezvous  # type: ignore[attr-defined]
    iterator = rendezvous(init_method, rank=rank, world_size=world_size, timeout=timeout)
    store, rank, world_size = next(iterator)
    store.set_timeout(timeout)
    claim_group_kind(store, "static")
    return store, rank, world_size, iterator


_GROUP_KIND = "distgrad/group-kind"


def claim_group_kind(store: Any, kind: str) -> None:
    """Mark the store's group static or dynamic; raise torch's error for a worker of the other
    kind."""
    found = bytes(store.compare_set(_GROUP_KIND, "", kind)).decode()
    if found != kind:
        raise RuntimeError(
            "RPC group mixes statically and dynamically initialized members which is not supported."
        )


@dataclass(frozen=True)
class ClusterSecret:
    """The handshake key, and whether it was set on this rank (``secret=`` or
    ``$DISTGRAD_SECRET``) rather than made by rank 0 and read from the store."""

    key: bytes
    explicit: bool


def agree_secret(store: Any, rank: int, options: TensorPipeRpcBackendOptions) -> ClusterSecret:
    """The cluster secret: from the options, else ``$DISTGRAD_SECRET``, else made by rank 0
    and shared through the store (which must then be trusted).

    Rank 0 always says in the store which it did, so a rank without a secret of its own never
    waits for a generated one that rank 0, holding an explicit secret, will never write. A
    secret set on some ranks only is reported by :func:`exchange_addresses`, on every rank."""
    explicit = options.secret
    if explicit is None:
        from_env = _config.env_str(_config.ENV_SECRET)
        explicit = from_env.encode() if from_env is not None else None
    if rank == 0:
        if explicit is not None:
            store.set(_SECRET_SOURCE, _EXPLICIT)
            return ClusterSecret(explicit, True)
        # (a rank 0 relaunched into a dynamic group whose store outlived it keeps the secret
        # the members already use)
        token = bytes(store.compare_set(_SECRET_KEY, "", secrets.token_hex(32))).decode()
        store.set(_SECRET_SOURCE, _GENERATED)
        return ClusterSecret(token.encode(), False)
    if explicit is not None:
        return ClusterSecret(explicit, True)
    if bytes(store.get(_SECRET_SOURCE)).decode() != _GENERATED:
        # Rank 0 has a secret of its own and shares none: this rank fails in
        # exchange_addresses, with every other; until then a key that matches nobody's.
        return ClusterSecret(secrets.token_hex(32).encode(), False)
    return ClusterSecret(bytes(store.get(_SECRET_KEY)), False)


def _check_secrets(explicit: dict[int, bool]) -> str | None:
    """Why the ranks cannot agree on a secret (set on some ranks only), or None."""
    with_secret = [rank for rank, has in explicit.items() if has]
    without = [rank for rank, has in explicit.items() if not has]
    if not with_secret or not without:
        return None
    return (
        f"the cluster secret is set on ranks {with_secret} but not on ranks {without} "
        f"(TensorPipeRpcBackendOptions(secret=...) or ${_config.ENV_SECRET}): set the same "
        "secret on every rank, or on none (rank 0 then makes one and shares it through the "
        "rendezvous store)"
    )


def listen_host(init_method: str, options: TensorPipeRpcBackendOptions) -> str:
    """The address to listen on for TCP: explicit option or ``$DISTGRAD_LISTEN_ADDR``, else
    one that peers on other hosts can reach (``_addresses``)."""
    explicit = options.listen_addr or _config.env_str(_config.ENV_LISTEN_ADDR)
    if explicit:
        return explicit
    master: str | None = None
    if init_method.startswith("env://"):
        master = os.environ.get("MASTER_ADDR")
    elif init_method.startswith("tcp://"):
        master = urlparse(init_method).hostname
    return listen_host_for(master)


def exchange_addresses(
    store: Any,
    info: WorkerInfo,
    address: PeerAddress,
    world_size: int,
    explicit_secret: bool,
    devices: dict[str, Any] | None = None,
) -> tuple[list[WorkerInfo], dict[int, PeerAddress], DevicePlan]:
    """Publish this worker (with its ``devices``: device count, maps and devices), wait for
    all others, validate names, that the secret is set on every rank or on none, and
    everyone's device maps (torch's init-time ValueErrors); return everyone and this
    worker's device plan."""
    if int(store.add(f"distgrad/rank/{info.id}", 1)) > 1:
        raise RuntimeError(f"RPC rank {info.id} is used by more than one worker")
    record = address_record(info, address, explicit_secret, devices)
    store.set(f"distgrad/worker/{info.id}", json.dumps(record))
    keys = [f"distgrad/worker/{rank}" for rank in range(world_size)]
    try:
        store.wait(keys)
    except Exception as exc:
        missing = [rank for rank, key in enumerate(keys) if not store.check([key])]
        raise RuntimeError(
            f"timed out waiting for ranks {missing} to join the RPC group of {world_size}"
        ) from exc
    workers: list[WorkerInfo] = []
    addresses: dict[int, PeerAddress] = {}
    seen: dict[str, int] = {}
    records = [json.loads(bytes(raw)) for raw in store.multi_get(keys)]
    # Every worker reads the same records and fails alike; they leave together, so that rank 0
    # (which hosts the TCPStore) does not take the store away from readers.
    explicit = {rank: bool(rec.get("explicit_secret")) for rank, rec in enumerate(records)}
    mismatch = _check_secrets(explicit)
    if mismatch is not None:
        barrier(store, "distgrad/secrets-checked", world_size, hosts_store=info.id == 0)
        raise RuntimeError(mismatch)
    for rank, rec in enumerate(records):
        name = str(rec["name"])
        if name in seen:
            barrier(store, "distgrad/names-checked", world_size, hosts_store=info.id == 0)
            raise RuntimeError(
                f"RPC worker name {name} is not unique. Workers {seen[name]} and {rank} share "
                "the same name."
            )
        seen[name] = rank
        workers.append(WorkerInfo(name, rank))
        addresses[rank] = address_from_record(rec)
    names = [w.name for w in workers]
    try:
        plan = plan_devices(info.name, names, {str(r["name"]): r.get("devices") for r in records})
    except ValueError:
        barrier(store, "distgrad/devices-checked", world_size, hosts_store=info.id == 0)
        raise
    return workers, addresses, plan


def address_record(
    info: WorkerInfo,
    address: PeerAddress,
    explicit_secret: bool,
    devices: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """What a worker publishes about itself (plain JSON; ``devices`` from
    ``_devices._maps.maps_to_record``)."""
    return {
        "devices": devices,
        "name": info.name,
        "host": address.host,
        "port": address.port,
        "unix": address.unix.encode("latin-1").hex() if address.unix else None,
        "host_id": address.host_id,
        "max_message_size": address.max_message_size,
        "explicit_secret": explicit_secret,
        "tls": address.tls,
        "incarnation": address.incarnation,
    }


def address_from_record(rec: dict[str, Any]) -> PeerAddress:
    """The address in a record made by :func:`address_record`."""
    unix = bytes.fromhex(rec["unix"]).decode("latin-1") if rec["unix"] else None
    return PeerAddress(
        str(rec["host"]),
        int(rec["port"]),
        unix,
        str(rec["host_id"]),
        int(rec.get("max_message_size") or 0),
        bool(rec.get("tls")),
        int(rec.get("incarnation") or 0),
    )


def barrier(store: Any, key: str, world_size: int, *, hosts_store: bool = False) -> None:
    """Every worker arrives at ``key`` before any leaves. With ``hosts_store`` (the worker
    that hosts the store, about to close it) this also waits until every other worker has
    left: one slow to read that the barrier opened would otherwise find the store gone
    ("Failed to recv ... Connection was likely closed") instead of the error they share."""
    if int(store.add(f"{key}/count", 1)) == world_size:
        store.set(f"{key}/done", "1")
    store.wait([f"{key}/done"])
    if int(store.add(f"{key}/left", 1)) == world_size:
        store.set(f"{key}/all-left", "1")
    elif hosts_store:
        store.wait([f"{key}/all-left"])
