"""The public RPC functions (``distgrad.rpc`` re-exports them), shaped like torch's."""

from __future__ import annotations

import atexit
import contextlib
import functools
import itertools
import logging
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
from . import _collectives, _rendezvous
from ._agent import RpcAgent, current_agent, set_current_agent
from ._calls import is_builtin
from ._options import (
    BackendType,
    FaultyTensorPipeRpcBackendOptions,
    RpcBackendOptions,
    TensorPipeRpcBackendOptions,
    construct_rpc_backend_options,
    is_backend_type,
)
from ._remote import create_remote
from ._rref import RRef
from ._worker_info import WorkerInfo, validate_worker_name

__all__ = [
    "get_rpc_timeout",
    "get_worker_info",
    "init_rpc",
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

    Rendezvous uses ``rpc_backend_options.init_method`` (``env://`` by default: MASTER_ADDR,
    MASTER_PORT, and RANK / WORLD_SIZE when not given). Returns when every worker of the
    group has joined.
    """
    if backend is not None and not is_backend_type(backend):
        raise TypeError("Argument backend must be a member of BackendType")
    if rpc_backend_options is not None and not _is_options(rpc_backend_options):
        raise TypeError("Argument rpc_backend_options must be an instance of RpcBackendOptions")
    if backend is None and rpc_backend_options is not None:
        if not _is_options(rpc_backend_options):
            raise TypeError(f"Could not infer backend for options {rpc_backend_options}")
        backend = BackendType.TENSORPIPE
    if backend is None:
        backend = BackendType.TENSORPIPE
    if rpc_backend_options is None:
        rpc_backend_options = construct_rpc_backend_options(backend)
    if backend.name == "TENSORPIPE" and not (
        isinstance(rpc_backend_options, TensorPipeRpcBackendOptions)
        or hasattr(rpc_backend_options, "num_worker_threads")
    ):
        raise TypeError(
            f"`rpc_backend_options` must be a `TensorPipeRpcBackendOptions`. {rpc_backend_options}"
        )
    if backend.name == "FAULTY_TENSORPIPE" and not isinstance(
        rpc_backend_options, FaultyTensorPipeRpcBackendOptions
    ):
        raise TypeError(
            "`rpc_backend_options` must be a `FaultyTensorPipeRpcBackendOptions`. "
            f"{rpc_backend_options}"
        )
    options = _to_options(rpc_backend_options)
    transport: TransportFactory = SocketTransport
    if isinstance(options, FaultyTensorPipeRpcBackendOptions):
        transport = FaultyTransport.factory(SocketTransport, options.fault_plan())
    validate_worker_name(name)
    with _init_lock:
        if current_agent() is not None:
            raise RuntimeError("RPC is already initialized")
        timeout = _rendezvous.store_timeout(options.rpc_timeout)
        store, rank, world_size, iterator = _rendezvous.open_store(
            options.init_method, rank, world_size, timeout
        )
        prefix = f"rpc_prefix_{next(_init_counter)}"
        store = torch.distributed.PrefixStore(prefix, store)  # type: ignore[attr-defined]
        for hook in init_hooks:
            hook(rank)
        agent = RpcAgent(name, rank, world_size, options, transport=transport)
        agent.keepalive += [store, iterator]
        try:
            secret = _rendezvous.agree_secret(store, rank, options)
            address = agent.start_transport(
                secret, _rendezvous.listen_host(options.init_method, options)
            )
            workers, addresses = _rendezvous.exchange_addresses(
                store, agent.worker_info, address, world_size
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
    they cause) to finish. ``timeout`` (seconds, 0 = none) bounds the whole wait; a dead peer
    ends it early with an error. Whatever happens, the agent is stopped before this returns
    or raises, and ``init_rpc`` may be called again.
    """
    agent = _agent()
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

            _collectives.wait_all_workers(remaining())
            for hook in list(agent.shutdown_hooks):
                hook()
            agent.rrefs.delete_all_users(_rref_drain_timeout(agent, deadline))
            while True:
                agent.wait_until_idle(deadline)
                counts = _collectives.all_gather(agent.active_calls(), timeout=remaining())
                if sum(counts.values()) == 0:
                    break
    finally:
        set_current_agent(None)
        agent.stop(graceful)
    _check_rref_leaks(agent)


def _rref_drain_timeout(agent: RpcAgent, deadline: float | None) -> float:
    """How long shutdown waits for RRef users to be deleted: what is left of its timeout, or
    (with none) the default RPC timeout (60 s if that is infinite too)."""
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
    """``WorkerInfo`` of ``worker_name``, or of this worker when ``None``."""
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
    """Run ``func(*args, **kwargs)`` on worker ``to`` and return its result (blocking).

    ``timeout`` in seconds; ``-1`` uses the default (``get_rpc_timeout()``), ``0`` waits
    forever. A remote exception is re-raised here with its original type, its message
    carrying the remote traceback.
    """
    agent = _agent()
    dst = _to_worker_info(agent, to)
    if not callable(func):
        raise TypeError("function should be callable.")
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
    """Run ``func(*args, **kwargs)`` on worker ``to``; return a ``torch.futures.Future``."""
    agent = _agent()
    dst = _to_worker_info(agent, to)
    if not callable(func):
        raise TypeError("function should be callable.")
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
    """Run ``func(*args, **kwargs)`` on worker ``to``; return an ``RRef`` to the result at once.

    The result stays on ``to`` (its owner). ``timeout`` bounds the creation; a creation that
    fails or times out is reported when the RRef is next used (``to_here``, passed in a call).

    Example::

        rref = rpc.remote("worker1", torch.add, args=(torch.ones(2), 3))
        rref.to_here()  # tensor([4., 4.])
    """
    agent = _agent()
    dst = _to_worker_info(agent, to)
    if not callable(func):
        raise TypeError("function should be callable.")
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
    """The default timeout of new RPCs, in seconds."""
    return _agent().rpc_timeout


def set_rpc_timeout(rpc_timeout: float) -> None:
    """Change the default timeout of new RPCs (seconds; 0 = none)."""
    _agent().rpc_timeout = float(rpc_timeout)
