"""The public RPC functions (``distgrad.rpc`` re-exports them), shaped like torch's."""

from __future__ import annotations

import atexit
import contextlib
import functools
import itertools
import logging
import numbers
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar, cast

import torch

from .. import _config
from .._errors import RpcTimeoutError
from .._transport._base import TransportFactory
from .._transport._faulty import FaultyTransport
from .._transport._transport import SocketTransport
from . import _collectives, _dynamic, _rendezvous
from ._agent import RpcAgent, current_agent, set_current_agent
from ._calls import is_builtin
from ._options import (
    BackendType,
    FaultyTensorPipeRpcBackendOptions,
    RpcBackendOptions,
    TensorPipeRpcBackendOptions,
    construct_rpc_backend_options,
    infer_backend,
    is_backend_type,
)
from ._remote import create_remote
from ._rref import RRef
from ._torchscript import as_rpc_target
from ._worker_info import WorkerInfo, validate_worker_name

__all__ = [
    "get_rpc_timeout",
    "get_worker_info",
    "init_rpc",
    "init_rpc_backend",
    "remote",
    "rpc_async",
    "rpc_sync",
    "shutdown",
    "wait_all",
]

F = TypeVar("F", bound=Callable[..., Any])
To = str | int | WorkerInfo

_init_lock = threading.Lock()
_init_counter = itertools.count()
_failed_stores: list[Any] = []
#: Callables run by ``init_rpc(rank)`` before the agent starts (dist autograd registers here).
init_hooks: list[Callable[[int], None]] = []


def _agent() -> RpcAgent:
    agent = current_agent()
    if agent is None:
        raise RuntimeError(
            "RPC has not been initialized. Call torch.distributed.rpc.init_rpc first."
        )
    return agent


def _require_initialized(func: F) -> F:
    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        _agent()
        return func(*args, **kwargs)

    return cast(F, wrapper)


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
        world_size (int, optional): number of workers in the group. ``None`` with
            ``init_method="env://"`` reads ``WORLD_SIZE``; groups whose members join and leave
            are not supported.
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
            for hook in init_hooks:
                hook(int(rank))
            _start_dynamic_agent(store, name, int(rank), options, transport)
            return
        store, rank, world_size, iterator = _rendezvous.open_store(
            options.init_method, rank, world_size, timeout
        )
        prefix = f"rpc_prefix_{next(_init_counter)}"
        store = torch.distributed.PrefixStore(prefix, store)  # type: ignore[attr-defined]
        for hook in init_hooks:
            hook(rank)
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
        workers, addresses = _rendezvous.exchange_addresses(
            store, agent.worker_info, address, world_size, secret.explicit
        )
        agent.set_peers(workers, addresses)
        set_current_agent(agent)
        _register_exit_hook()
        _rendezvous.barrier(store, "distgrad/ready", world_size)
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
    except BaseException:
        set_current_agent(None)
        agent.stop(graceful=False)
        _failed_stores.append(store)
        raise


_exit_hook_registered = False


def _register_exit_hook() -> None:
    global _exit_hook_registered
    if not _exit_hook_registered:
        atexit.register(_stop_at_exit)
        _exit_hook_registered = True


def _stop_at_exit() -> None:
    """Stop an agent that the program left running (it ended, or raised, without
    ``shutdown()``), while the interpreter is still whole: the agent's I/O thread must not
    outlive it. An event of its loop firing during finalization (a heartbeat timer, a peer's
    frame) would call into an interpreter that is gone, and the process would die of SIGSEGV
    instead of exiting with the program's status. Not graceful: the peers see this worker
    leave as they would see it die. (atexit runs after the non-daemon threads have ended.)"""
    agent = current_agent()
    if agent is None or agent.pid != os.getpid():  # shut down already, or a forked child
        return
    try:
        shutdown(graceful=False)
    except Exception as exc:  # exiting anyway (e.g. an RRef leak reported): say so, go on
        logging.getLogger("distgrad.rpc").warning("stopping RPC at exit: %r", exc)


def shutdown(graceful: bool = True, timeout: float = _config.DEFAULT_SHUTDOWN_TIMEOUT) -> None:
    """Stop this worker's agent (torch's ``shutdown``).

    With ``graceful`` (the default) every worker first waits for all workers to reach
    shutdown, then for every RPC in flight anywhere in the group (including follow-up calls
    they cause) to finish, and for the users of RRefs this worker owns to be deleted. A
    worker that only serves calls typically calls ``shutdown()`` right after ``init_rpc``:
    it serves until every worker has reached shutdown. Whatever happens, the agent is stopped
    before this returns or raises, and ``init_rpc`` may be called again.

    Args:
        graceful (bool): wait for the group and for calls in flight (``True``), or stop at
            once (``False``: calls still waiting fail with ``RpcShutdownError``).
        timeout (float): seconds the graceful wait may take in all; ``0`` (the default)
            waits as long as it takes. A dead peer is left out of the wait (a warning names
            it): the survivors' graceful shutdown returns.

    Raises:
        RuntimeError: RPC is not initialized; with ``rpc.api._ignore_rref_leak = False``,
            "Leaking RRef ..." when forks of RRefs owned here were still registered.
        RpcTimeoutError: the graceful wait passed ``timeout`` (the agent is stopped anyway).
        PeerFailureError: a peer was lost during the graceful wait without being proved
            dead (suspected: it may come back).

    Example:
        # The worker that does the work and the worker that serves it.

        # on worker 0
        rpc.init_rpc("worker0", rank=0, world_size=2)
        rpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), 1))
        rpc.shutdown()  # returns once worker1 reached shutdown and nothing is in flight

        # on worker 1
        rpc.init_rpc("worker1", rank=1, world_size=2)
        rpc.shutdown()  # serves worker0 meanwhile
    """
    agent = _agent()
    if agent.dynamic:
        _leave(agent, graceful, timeout)
        return
    try:
        if graceful:
            deadline = time.monotonic() + timeout if timeout > 0 else None

            def remaining() -> float:
                if deadline is None:
                    return 0
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RpcTimeoutError(
                        f"shutdown timed out after {timeout:g}s waiting for other workers"
                    )
                return left

            _collectives.all_gather_survivors(None, remaining())
            for hook in list(agent.shutdown_hooks):
                hook()
            agent.rrefs.delete_all_users(_rref_drain_timeout(agent, deadline))
            while True:
                agent.wait_until_idle(deadline)
                counts = _collectives.all_gather_survivors(agent.active_calls(), remaining())
                if sum(counts.values()) == 0:
                    break
    finally:
        set_current_agent(None)
        agent.stop(graceful=graceful)
    _check_rref_leaks(agent)


def _leave(agent: RpcAgent, graceful: bool, timeout: float) -> None:
    """``shutdown()`` of a member of a dynamic group: it leaves; the others go on. Graceful:
    its own calls finish, its RRef users are deleted, every member is told it leaves."""
    try:
        if graceful:
            deadline = time.monotonic() + timeout if timeout > 0 else None
            agent.wait_until_idle(deadline)
            for hook in list(agent.shutdown_hooks):
                hook()
            agent.rrefs.delete_all_users(_rref_drain_timeout(agent, deadline))
            budget = (
                max(deadline - time.monotonic(), 0.1) if deadline is not None else agent.rpc_timeout
            )
            store = agent.keepalive[0] if agent.keepalive else None
            _dynamic.leave_group(agent, store, budget)
    finally:
        set_current_agent(None)
        agent.stop(graceful=graceful)
    _check_rref_leaks(agent)


_DEAD_PEER_RREF_DRAIN_S = 1.0


def _rref_drain_timeout(agent: RpcAgent, deadline: float | None) -> float:
    """How long shutdown waits for RRef users to be deleted: what is left of its timeout, or
    (with none) the default RPC timeout (60 s if that is infinite too); at most a moment when a
    peer is dead (the users it held are never deleted: they are leaks, not work to wait for)."""
    if agent.statistics().dead_peers:
        left = _DEAD_PEER_RREF_DRAIN_S if deadline is None else deadline - time.monotonic()
        return max(0.0, min(_DEAD_PEER_RREF_DRAIN_S, left))
    if deadline is not None:
        return max(0.0, deadline - time.monotonic())
    return agent.rpc_timeout if agent.rpc_timeout > 0 else _config.DEFAULT_RPC_TIMEOUT_SEC


def _check_rref_leaks(agent: RpcAgent) -> None:
    # ``rpc.api._ignore_rref_leak`` (default True), as in the reference: users set it on the
    # public module, so it is read from there.
    public = sys.modules.get("distgrad.rpc.api")
    if getattr(public, "_ignore_rref_leak", True) or not agent.rref_leaks:
        return
    rref_id, fork_id = agent.rref_leaks[0]
    raise RuntimeError(
        f"Leaking RRef {rref_id} with fork Id {fork_id}\n"
        f"({len(agent.rref_leaks)} forks were still registered at shutdown)"
    )


@_require_initialized
def get_worker_info(worker_name: str | None = None) -> WorkerInfo:
    """The ``WorkerInfo`` (name and id) of a worker of the group (torch's
    ``get_worker_info``).

    A ``WorkerInfo`` can be used wherever a destination is expected (``rpc_sync(info,
    ...)``); it saves looking the name up on every call.

    Args:
        worker_name (str, optional): the worker's name; ``None`` (the default) for this
            worker.

    Returns:
        WorkerInfo: ``WorkerInfo(id=rank, name=worker_name)``.

    Raises:
        RuntimeError: RPC is not initialized, or no worker of the group has that name
            (torch's "name:worker0,rank:0 could not find destination name worker9").

    Example:
        # On either of two workers:
        me = rpc.get_worker_info()  # WorkerInfo(id=0, name=worker0) on worker0
        peer = rpc.get_worker_info("worker1")  # WorkerInfo(id=1, name=worker1)
        rpc.rpc_sync(peer, torch.add, args=(torch.ones(2), peer.id))
    """
    return _agent().get_worker_info(worker_name)


def _to_worker_info(agent: RpcAgent, to: To) -> WorkerInfo:
    if isinstance(to, WorkerInfo):
        return to
    if isinstance(to, (str, int)):
        return agent.get_worker_info(to)
    raise ValueError(f"Cannot get WorkerInfo from name {to}")


_wait_all_state = threading.local()


@_require_initialized
def rpc_sync(
    to: To,
    func: Callable[..., Any],
    args: tuple[Any, ...] | None = None,
    kwargs: dict[str, Any] | None = None,
    timeout: float = _config.UNSET_RPC_TIMEOUT,
) -> Any:
    """Run ``func(*args, **kwargs)`` on worker ``to`` and return its result, blocking until
    it arrives (torch's ``rpc_sync``).

    Tensors in the arguments and in the result travel by value (their storage bytes, without
    a copy into the pickle). Inside a distributed autograd context the call is recorded, so
    ``dist_autograd.backward`` sends gradients back along it.

    Args:
        to (str or int or WorkerInfo): the destination: a worker name, a rank, or a
            ``WorkerInfo``. It may be this worker itself (a real call, through the wire).
        func (Callable): a Python function (sent by reference: module and name, so it must
            be importable on ``to``), a builtin torch operator such as ``torch.add``, or an
            ``@rpc.functions.async_execution`` function.
        args (tuple, optional): positional arguments of ``func``.
        kwargs (dict, optional): keyword arguments of ``func``.
        timeout (float): seconds; ``-1`` (the default) uses the default timeout
            (``get_rpc_timeout()``, set by ``rpc_timeout`` in the options), ``0`` waits
            without limit.

    Returns:
        The value ``func`` returned on ``to`` (for an ``@async_execution`` function, the
        value of the future it returned).

    Raises:
        RuntimeError: RPC is not initialized, or ``to`` names no worker of the group.
        ValueError: ``to`` is not a name, a rank or a ``WorkerInfo`` ("Cannot get WorkerInfo
            from name ...").
        TypeError: ``func`` is not callable ("function should be callable.").
        RpcTimeoutError: no answer within the timeout (torch's "RPC ran for more than set
            timeout (... ms) and will now be marked with an error"); a ``RuntimeError``.
        PeerFailureError: ``to`` died or its connection broke while the call waited.
        HandshakeError: the connection to ``to`` failed the authenticated handshake (``to``
            uses another cluster secret).
        MessageTooLargeError: the request or the response is above ``max_message_size``.
        Exception: what ``func`` raised on ``to``, with its original type and message; the
            message and ``err.remote_traceback`` hold the remote traceback.

    Example:
        # Two workers; worker1 only serves.

        # on worker 0
        import torch
        import distgrad.rpc as rpc

        rpc.init_rpc("worker0", rank=0, world_size=2)
        ret = rpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), 3))  # tensor([4., 4.])
        rpc.shutdown()

        # on worker 1
        import distgrad.rpc as rpc

        rpc.init_rpc("worker1", rank=1, world_size=2)
        rpc.shutdown()
    """
    agent = _agent()
    dst = _to_worker_info(agent, to)
    if not callable(func):
        raise TypeError("function should be callable.")
    func = as_rpc_target(func)
    return agent.call_sync(
        dst, func, tuple(args) if args else (), kwargs or {}, timeout, force=not is_builtin(func)
    )


@_require_initialized
def rpc_async(
    to: To,
    func: Callable[..., Any],
    args: tuple[Any, ...] | None = None,
    kwargs: dict[str, Any] | None = None,
    timeout: float = _config.UNSET_RPC_TIMEOUT,
) -> torch.futures.Future[Any]:
    """Run ``func(*args, **kwargs)`` on worker ``to`` without waiting: return a
    ``torch.futures.Future`` of its result (torch's ``rpc_async``).

    The call is on its way when this returns; ``fut.wait()`` blocks for the result and
    raises what the call raised, ``fut.then(callback)`` chains work on it (callbacks run on
    a thread of their own, never on distgrad's I/O thread, and may make RPCs). Inside
    ``with rpc._wait_all():`` the future is also waited for at the end of the block.

    Args:
        to (str or int or WorkerInfo): the destination: a worker name, a rank, or a
            ``WorkerInfo``. It may be this worker itself (a real call, through the wire).
        func (Callable): a Python function (sent by reference: module and name, so it must
            be importable on ``to``), a builtin torch operator such as ``torch.add``, or an
            ``@rpc.functions.async_execution`` function.
        args (tuple, optional): positional arguments of ``func``.
        kwargs (dict, optional): keyword arguments of ``func``.
        timeout (float): seconds; ``-1`` (the default) uses the default timeout
            (``get_rpc_timeout()``, set by ``rpc_timeout`` in the options), ``0`` waits
            without limit.

    Returns:
        torch.futures.Future: completes with ``func``'s result, or with the error that
        ``rpc_sync`` would have raised (timeout, dead peer, the remote exception).

    Raises:
        RuntimeError: RPC is not initialized, or ``to`` names no worker of the group.
        ValueError: ``to`` is not a name, a rank or a ``WorkerInfo``.
        TypeError: ``func`` is not callable ("function should be callable.").

    Example:
        # Two workers; two calls in flight at once.

        # on worker 0
        import torch
        import distgrad.rpc as rpc

        rpc.init_rpc("worker0", rank=0, world_size=2)
        fut1 = rpc.rpc_async("worker1", torch.add, args=(torch.ones(2), 3))
        fut2 = rpc.rpc_async("worker1", min, args=(1, 2))
        result = fut1.wait() + fut2.wait()  # tensor([5., 5.])
        rpc.shutdown()

        # on worker 1
        import distgrad.rpc as rpc

        rpc.init_rpc("worker1", rank=1, world_size=2)
        rpc.shutdown()
    """
    agent = _agent()
    dst = _to_worker_info(agent, to)
    if not callable(func):
        raise TypeError("function should be callable.")
    func = as_rpc_target(func)
    future = agent.call_async(
        dst, func, tuple(args) if args else (), kwargs or {}, timeout, force=not is_builtin(func)
    )
    collected = getattr(_wait_all_state, "futures", None)
    if collected is not None:
        collected.append(future)
    return future


@_require_initialized
def remote(
    to: To,
    func: Callable[..., Any],
    args: tuple[Any, ...] | None = None,
    kwargs: dict[str, Any] | None = None,
    timeout: float = _config.UNSET_RPC_TIMEOUT,
) -> RRef[Any]:
    """Run ``func(*args, **kwargs)`` on worker ``to`` and return at once an ``RRef`` to its
    result, which stays on ``to``, its owner (torch's ``remote``).

    The RRef can be used right away: passed to other workers in RPC arguments, fetched with
    ``to_here()``, or called through ``rref.rpc_sync().method(...)``; uses wait for the value
    where needed. The owner keeps the value while any reference to it exists anywhere.

    Args:
        to (str or int or WorkerInfo): the destination: a worker name, a rank, or a
            ``WorkerInfo``. It may be this worker itself (a real call, through the wire).
        func (Callable): a Python function (sent by reference: module and name, so it must
            be importable on ``to``), a builtin torch operator such as ``torch.add``, or an
            ``@rpc.functions.async_execution`` function.
        args (tuple, optional): positional arguments of ``func``.
        kwargs (dict, optional): keyword arguments of ``func``.
        timeout (float): seconds the *creation* may take; ``-1`` (the default) uses the
            default timeout
            (``get_rpc_timeout()``, set by ``rpc_timeout`` in the options), ``0`` waits
            without limit.

    Returns:
        RRef: a user reference to the value on ``to`` (an owner reference when ``to`` is this
        worker). A creation that fails or times out is recorded on it and raised by its next
        use (``to_here()``, passing it in a call), as in torch.

    Raises:
        RuntimeError: RPC is not initialized, or ``to`` names no worker of the group.
        ValueError: ``to`` is not a name, a rank or a ``WorkerInfo``.
        TypeError: ``func`` is not callable ("function should be callable.").

    Example:
        # Two workers; the values live on worker1.

        # on worker 0
        import torch
        import distgrad.rpc as rpc

        rpc.init_rpc("worker0", rank=0, world_size=2)
        rref1 = rpc.remote("worker1", torch.add, args=(torch.ones(2), 3))
        rref2 = rpc.remote("worker1", torch.add, args=(torch.ones(2), 1))
        x = rref1.to_here() + rref2.to_here()  # tensor([6., 6.])
        rpc.shutdown()

        # on worker 1
        import distgrad.rpc as rpc

        rpc.init_rpc("worker1", rank=1, world_size=2)
        rpc.shutdown()
    """
    agent = _agent()
    dst = _to_worker_info(agent, to)
    if not callable(func):
        raise TypeError("function should be callable.")
    func = as_rpc_target(func)
    return create_remote(
        agent,
        dst,
        func,
        tuple(args) if args else (),
        kwargs or {},
        timeout,
        force=not is_builtin(func),
    )


@contextlib.contextmanager
def wait_all() -> Iterator[None]:
    """Collect the futures of ``rpc_async`` calls made in the block and wait for all on exit."""
    previous = getattr(_wait_all_state, "futures", None)
    _wait_all_state.futures = []
    try:
        yield
    finally:  # as the reference: the futures are waited for even when the block raises
        futures = _wait_all_state.futures
        _wait_all_state.futures = previous
        torch.futures.wait_all(futures)


def get_rpc_timeout() -> float:
    """The default timeout of new RPCs, in seconds (torch's ``get_rpc_timeout``).

    It is ``rpc_timeout`` of the options given to ``init_rpc`` (60 by default) until
    ``rpc._set_rpc_timeout`` changes it; calls made with ``timeout=-1`` use it.

    Returns:
        float: seconds; ``0`` means no timeout.

    Raises:
        RuntimeError: RPC is not initialized.

    Example:
        # On any worker, after init_rpc:
        rpc.get_rpc_timeout()  # 60.0
        rpc._set_rpc_timeout(5)
        rpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), 1))  # at most 5 s
    """
    return _agent().rpc_timeout


def set_rpc_timeout(rpc_timeout: float) -> None:
    """Change the default timeout of new RPCs (seconds; 0 = none)."""
    _agent().rpc_timeout = float(rpc_timeout)
