"""``init_rpc`` and its checks: the options a backend takes, the rendezvous, the agent started
and made current (static groups or dynamic ones)."""

from __future__ import annotations

import itertools
import logging
import numbers
import os
import sys
import threading
from typing import Any

import torch

from ... import _config
from ..._transport._base import TransportFactory
from ..._transport._faulty import FaultyTransport
from ..._transport._transport import SocketTransport
from .._core import (
    BackendType,
    FaultyTensorPipeRpcBackendOptions,
    RpcAgent,
    RpcBackendOptions,
    TensorPipeRpcBackendOptions,
    construct_rpc_backend_options,
    current_agent,
    infer_backend,
    is_backend_type,
    set_current_agent,
    validate_worker_name,
)
from .._rrefs import _layer as _rref_layer
from . import _dynamic, _rendezvous
from ._shutdown import _register_exit_hook

__all__ = ["init_rpc", "init_rpc_backend"]

# RRefs are a layer over the agent (the agent core imports nothing of them): the module that
# starts agents plugs them in, before any agent starts.
_rref_layer.register()

_log = logging.getLogger("distgrad.rpc")
_init_lock = threading.Lock()
_init_counter = itertools.count()
_failed_stores: list[Any] = []


def _to_options(options: object) -> TensorPipeRpcBackendOptions:
    """Accept our options, or torch's own TensorPipe options object (copied over)."""
    if isinstance(options, TensorPipeRpcBackendOptions):
        return options
    if hasattr(options, "messages_to_fail"):  # torch's FaultyTensorPipeRpcBackendOptions
        return FaultyTensorPipeRpcBackendOptions(
            int(getattr(options, "num_worker_threads", 16)),
            float(getattr(options, "rpc_timeout", _config.DEFAULT_RPC_TIMEOUT_SEC)),
            str(getattr(options, "init_method", _config.DEFAULT_INIT_METHOD)),
            list(getattr(options, "messages_to_fail", [])),
            dict(getattr(options, "messages_to_delay", {})),
            int(getattr(options, "num_fail_sends", 0)),
        )
    converted = TensorPipeRpcBackendOptions(
        num_worker_threads=int(getattr(options, "num_worker_threads", 16)),
        rpc_timeout=float(getattr(options, "rpc_timeout", _config.DEFAULT_RPC_TIMEOUT_SEC)),
        init_method=str(getattr(options, "init_method", _config.DEFAULT_INIT_METHOD)),
        device_maps=dict(getattr(options, "device_maps", None) or {}),
        devices=list(getattr(options, "devices", None) or []),
    )
    return converted


def _is_options(options: object) -> bool:
    if isinstance(options, RpcBackendOptions):
        return True
    torch_options = getattr(torch.distributed.rpc, "RpcBackendOptions", None)
    return torch_options is not None and isinstance(options, torch_options)


def init_rpc(
    name: str,
    backend: Any = None,
    rank: int = -1,
    world_size: int | None = None,
    rpc_backend_options: RpcBackendOptions | None = None,
) -> None:
    """Start this worker's RPC agent and join the group (torch's ``init_rpc``).

    Every worker of the group calls it with its own ``name`` and ``rank``; it returns once
    every worker has joined and can serve calls. It also initializes distributed autograd
    (``distgrad.autograd``) for this worker, with the rank as its worker id. After
    :func:`shutdown`, ``init_rpc`` may be called again (a new group).

    Args:
        name (str): this worker's globally unique name, e.g. ``"trainer0"``: letters, digits,
            ``-``, ``_`` and ``:``, 1 to 127 characters.
        backend (BackendType, optional): ``BackendType.TENSORPIPE`` (the default; accepted so
            torch programs run unchanged: the agent is always distgrad's) or a registered
            backend. When ``None`` it is inferred from ``rpc_backend_options``.
        rank (int): this worker's rank, ``0 <= rank < world_size``. ``-1`` (the default) with
            ``init_method="env://"`` reads ``RANK`` from the environment.
        world_size (int, optional): number of workers in a static group. ``None`` (the
            default) with ``init_method="env://"`` reads ``WORLD_SIZE``; without it (or with
            ``tcp://`` or ``file://``) the worker joins a *dynamic* group whose members join
            and leave, led by rank 0 (docs/elastic.md). With ``tcp://``/``env://``, rank 0
            hosts the group's store and its death ends joins, unless the store lives outside
            the members (torchrun's agent store, ``TORCHELASTIC_USE_AGENT_STORE=True``) or
            ``file://`` on shared storage is used.
        rpc_backend_options (TensorPipeRpcBackendOptions, optional): timeouts, the rendezvous
            ``init_method`` (``env://`` by default: ``MASTER_ADDR`` and ``MASTER_PORT``; also
            ``tcp://host:port`` and ``file://path``), worker threads and distgrad's own
            options (cluster secret, TLS, message size, failure detection). torch's own
            ``TensorPipeRpcBackendOptions`` is accepted too.

    Raises:
        TypeError: ``backend`` is not a ``BackendType`` member, or ``rpc_backend_options``
            is not backend options (torch's messages, e.g. "Argument backend must be a member
            of BackendType").
        RuntimeError: "RPC is already initialized"; a name torch refuses ("Worker name must
            match ^[A-Za-z0-9-_:]*$, ..."); two workers with the same name ("... is not
            unique"); the rendezvous timed out (after ``rpc_timeout``); no world size.

    Example:
        # The same program on two workers: distgrad run -n 2 prog.py (or torchrun) sets
        # MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE.

        # on worker 0 (RANK=0)
        import torch
        import distgrad.rpc as rpc

        rpc.init_rpc("worker0", rank=0, world_size=2)
        print(rpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), 3)))  # tensor([4., 4.])
        rpc.shutdown()

        # on worker 1 (RANK=1)
        import distgrad.rpc as rpc

        rpc.init_rpc("worker1", rank=1, world_size=2)
        rpc.shutdown()  # serves worker0's calls until worker0 shuts down too
    """
    if backend is not None and not is_backend_type(backend):
        raise TypeError("Argument backend must be a member of BackendType")
    if rpc_backend_options is not None and not _is_options(rpc_backend_options):
        raise TypeError("Argument rpc_backend_options must be an instance of RpcBackendOptions")
    if backend is None and rpc_backend_options is not None:
        backend = infer_backend(rpc_backend_options)
    if backend is None:
        backend = BackendType.TENSORPIPE
    if rpc_backend_options is None:
        rpc_backend_options = construct_rpc_backend_options(backend)
    options, transport = _check_options(backend, rpc_backend_options)
    if not isinstance(name, str):  # torch's check (made before the rendezvous here)
        raise RuntimeError(f"Argument {name} must be of type {str} but got type {type(name)}")
    validate_worker_name(name)
    with _init_lock:
        if current_agent() is not None:
            raise RuntimeError("RPC is already initialized")
        timeout = _rendezvous.store_timeout(options.rpc_timeout)
        if world_size is None and not (
            options.init_method.startswith("env://") and os.environ.get("WORLD_SIZE")
        ):
            store, rank = _dynamic.open_dynamic_store(options, int(rank), timeout)
            store = torch.distributed.PrefixStore("rpc_dynamic", store)  # type: ignore[attr-defined]
            _start_dynamic_agent(store, name, int(rank), options, transport)
            return
        store, rank, world_size, iterator = _rendezvous.open_store(
            options.init_method, rank, world_size, timeout
        )
        prefix = f"rpc_prefix_{next(_init_counter)}"
        store = torch.distributed.PrefixStore(prefix, store)  # type: ignore[attr-defined]
        _start_agent(store, name, rank, world_size, options, transport, keepalive=[iterator])


def _check_options(
    backend: Any, options: object
) -> tuple[TensorPipeRpcBackendOptions, TransportFactory]:
    """``options`` as distgrad's agent takes them and the transport they ask for, or torch's
    error for options that do not belong to ``backend``."""
    if backend.name == "TENSORPIPE" and not (
        isinstance(options, TensorPipeRpcBackendOptions) or hasattr(options, "num_worker_threads")
    ):
        raise TypeError(f"`rpc_backend_options` must be a `TensorPipeRpcBackendOptions`. {options}")
    if backend.name == "FAULTY_TENSORPIPE" and not isinstance(
        options, FaultyTensorPipeRpcBackendOptions
    ):
        raise TypeError(
            f"`rpc_backend_options` must be a `FaultyTensorPipeRpcBackendOptions`. {options}"
        )
    checked = _to_options(options)
    transport: TransportFactory = SocketTransport
    if isinstance(checked, FaultyTensorPipeRpcBackendOptions):
        transport = FaultyTransport.factory(SocketTransport, checked.fault_plan())
    return checked, transport


def init_rpc_backend(
    backend: Any = BackendType.TENSORPIPE,
    store: Any = None,
    name: str | None = None,
    rank: int = -1,
    world_size: int | None = None,
    rpc_backend_options: RpcBackendOptions | None = None,
) -> None:
    """torch's ``rpc._init_rpc_backend``: start the agent on a store the caller made (a
    ``torch.distributed.Store`` every worker of the group shares), without the rendezvous of
    ``init_rpc`` -- and, as torch's, without initializing distributed autograd."""
    _validate_rpc_args(backend, store, name, rank, world_size, rpc_backend_options)
    assert name is not None and rpc_backend_options is not None  # checked above
    if world_size is None:
        raise RuntimeError(
            "distgrad needs a static RPC group: pass world_size (dynamic groups are not "
            "supported yet)"
        )
    options, transport = _check_options(backend, rpc_backend_options)
    validate_worker_name(name)
    with _init_lock:
        if current_agent() is not None:
            raise RuntimeError("RPC is already initialized")
        _start_agent(store, name, rank, world_size, options, transport, keepalive=[])


def _validate_rpc_args(
    backend: Any,
    store: Any,
    name: object,
    rank: object,
    world_size: object,
    options: object,
) -> None:
    """torch's ``_validate_rpc_args``, with its message."""
    checks: list[tuple[object, Any, bool]] = [
        (backend, BackendType, is_backend_type(backend)),
        (store, torch.distributed.Store, isinstance(store, torch.distributed.Store)),  # type: ignore[attr-defined]
        (name, str, isinstance(name, str)),
        (rank, numbers.Integral, isinstance(rank, numbers.Integral)),
        (
            world_size,
            (numbers.Integral, type(None)),
            isinstance(world_size, (numbers.Integral, type(None))),
        ),
        (options, RpcBackendOptions, _is_options(options)),
    ]
    for arg, arg_type, ok in checks:
        if not ok:
            raise RuntimeError(
                f"Argument {arg} must be of type {arg_type} but got type {type(arg)}"
            )


def _log_started(agent: RpcAgent) -> None:
    """One INFO line: which RPC this process runs (docs/libraries.md, "Which RPC runs")."""
    torch_rpc = sys.modules.get("torch.distributed.rpc")
    patched = torch_rpc is not None and torch_rpc.__name__ == "distgrad.rpc"
    _log.info(
        "init_rpc: worker %r (rank %d) runs distgrad's RPC; torch.distributed.rpc is %s",
        agent.worker_info.name,
        agent.worker_info.id,
        "distgrad's (patched)" if patched else "torch's own (not patched)",
    )


def _start_agent(
    store: Any,
    name: str,
    rank: int,
    world_size: int,
    options: TensorPipeRpcBackendOptions,
    transport: TransportFactory,
    keepalive: list[Any],
) -> None:
    """Start the agent, meet the group through ``store`` and make the agent current (the
    caller holds ``_init_lock``)."""
    agent = RpcAgent(name, rank, world_size, options, transport=transport)
    agent.keepalive += [store, *keepalive]
    try:
        secret = _rendezvous.agree_secret(store, rank, options)
        address = agent.start_transport(
            secret.key, _rendezvous.listen_host(options.init_method, options)
        )
        workers, addresses, plan = _rendezvous.exchange_addresses(
            store, agent.worker_info, address, world_size, secret.explicit, agent.device_record()
        )
        agent.set_peers(workers, addresses)
        agent.set_device_plan(plan)
        set_current_agent(agent)
        _register_exit_hook()
        _rendezvous.barrier(store, "distgrad/ready", world_size)
        _log_started(agent)
    except BaseException:
        set_current_agent(None)
        agent.stop(graceful=False)
        # Rank 0 hosts the TCPStore: keep it up after a failed init, as other workers may
        # still be reading from it (they would see "Broken pipe" or hang otherwise).
        _failed_stores.append(store)
        raise


def _start_dynamic_agent(
    store: Any,
    name: str,
    rank: int,
    options: TensorPipeRpcBackendOptions,
    transport: TransportFactory,
) -> None:
    """Start the agent of a dynamic group and join the group (the caller holds
    ``_init_lock``)."""
    agent = RpcAgent(name, rank, 0, options, transport=transport, dynamic=True)
    agent.keepalive.append(store)
    try:
        secret = _rendezvous.agree_secret(store, rank, options)
        address = agent.start_transport(
            secret.key, _rendezvous.listen_host(options.init_method, options)
        )
        set_current_agent(agent)
        _dynamic.join_group(agent, store, address, secret.explicit, options.rpc_timeout)
        _register_exit_hook()
        _log_started(agent)
    except BaseException:
        set_current_agent(None)
        agent.stop(graceful=False)
        _failed_stores.append(store)
        raise
