"""The public RPC functions (``distgrad.rpc`` re-exports them), shaped like torch's; ``init_rpc``
lives in ``_init``, ``shutdown`` in ``_shutdown``."""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar, cast

import torch

from .. import _config
from .._errors import PeerFailureError
from ._core import (
    SCRIPT_TARGETS,
    RpcAgent,
    RpcFuture,
    WorkerInfo,
    as_rpc_target,
    failed_future,
    is_builtin,
    require_agent,
    rref_limit,
)
from ._group._init import init_rpc, init_rpc_backend
from ._group._shutdown import shutdown
from ._rrefs._rref import RRef, create_remote

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


_agent = require_agent


# ``rpc_sync``, ``rpc_async`` and ``remote`` check it on their first line instead (the same
# error, without a wrapper's calls on every RPC).
def _require_initialized(func: F) -> F:
    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        _agent()
        return func(*args, **kwargs)

    return cast(F, wrapper)


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


def _holds_rref(value: Any, depth: int = 0) -> bool:
    """True if ``value`` is an RRef or a list, tuple or dict holding one (a few levels down:
    what a TorchScript signature can declare)."""
    if isinstance(value, RRef):
        return True
    if depth < 4:
        if isinstance(value, (list, tuple)):
            return any(_holds_rref(item, depth + 1) for item in value)
        if isinstance(value, dict):
            return any(_holds_rref(item, depth + 1) for item in value.values())
    return False


def _refuse_rrefs(func: Any, args: Any, kwargs: Any) -> None:
    """A TorchScript target cannot take distgrad RRefs: refuse the call before it is sent
    (the callee's TorchScript would refuse the argument's type)."""
    if _holds_rref(args) or _holds_rref(kwargs):
        raise rref_limit(f"calling TorchScript function {func.qualified_name} with an RRef")


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
    dst = agent.get_worker_info(to) if isinstance(to, (str, int)) else _to_worker_info(agent, to)
    if not callable(func):
        raise TypeError("function should be callable.")
    if hasattr(func, "_wrapped_async_rpc_function"):  # (the common case skips the call)
        func = as_rpc_target(func)
    if type(func) in SCRIPT_TARGETS:
        _refuse_rrefs(func, args, kwargs)
    # (the outgoing stage's own call_sync: the agent's would only delegate to it; force=None:
    # recorded in a context unless func is a builtin operator, decided only if it is)
    return agent._outgoing.call_sync(
        dst, func, tuple(args) if args else (), kwargs or {}, timeout, force=None
    )


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
        ``rpc_sync`` would have raised (timeout, dead peer, the remote exception). A peer
        already known dead fails the future (``PeerFailureError`` from ``wait()``), as
        torch's does; it is not raised here.

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
    dst = agent.get_worker_info(to) if isinstance(to, (str, int)) else _to_worker_info(agent, to)
    if not callable(func):
        raise TypeError("function should be callable.")
    if hasattr(func, "_wrapped_async_rpc_function"):  # (the common case skips the call)
        func = as_rpc_target(func)
    if type(func) in SCRIPT_TARGETS:
        _refuse_rrefs(func, args, kwargs)
    args, kwargs = tuple(args) if args else (), kwargs or {}
    try:  # (as rpc_sync: the outgoing stage's own call_async)
        future = agent._outgoing.call_async(dst, func, args, kwargs, timeout, force=None)
    except PeerFailureError as exc:  # as torch's: a peer known dead fails the future
        future = failed_future(exc, agent._pools)
    collected = getattr(_wait_all_state, "future_list", None)
    if collected is not None:
        collected.append(future)
    return future


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
    if hasattr(func, "_wrapped_async_rpc_function"):  # (the common case skips the call)
        func = as_rpc_target(func)
    if type(func) in SCRIPT_TARGETS:
        _refuse_rrefs(func, args, kwargs)
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
    """Collect the futures of ``rpc_async`` calls made in the block and wait for them on exit
    (torch's ``rpc._wait_all``); the first of them to fail ends the wait with its error, as
    torch's does, without waiting for the others."""
    previous = getattr(_wait_all_state, "future_list", None)
    _wait_all_state.future_list = []
    try:
        yield
    finally:  # as the reference: the futures are waited for even when the block raises
        futures = _wait_all_state.future_list
        if previous is None:  # (torch's tests check that the attribute is gone afterwards)
            del _wait_all_state.future_list
        else:
            _wait_all_state.future_list = previous
        _wait_until_all_or_one_failed(futures)


def _wait_until_all_or_one_failed(futures: list[torch.futures.Future[Any]]) -> None:
    """Return once every future succeeded; raise the error of the first one that fails.

    (``torch.futures.wait_all`` cannot stop at a distgrad future's failure: a pure-Python
    future that failed is, to torch's C++ future, one that completed -- see
    docs/migration.md.) The wait frees an agent thread's pool slot, as ``wait()`` does."""
    if not futures:
        return
    pools = next((f._pools for f in futures if isinstance(f, RpcFuture)), ())
    gate = RpcFuture()  # (its wait() frees a pool slot)
    gate._pools = pools
    lock = threading.Lock()
    left = [len(futures)]

    def done(future: torch.futures.Future[Any]) -> None:
        try:
            future.wait()
        except BaseException:
            outcome: torch.futures.Future[Any] | None = future
        else:
            outcome = None
        with lock:
            if gate.done():
                return
            left[0] -= 1
            if outcome is None and left[0] > 0:
                return
            gate.set_result(outcome)

    for future in futures:
        future.add_done_callback(done)
    failed = gate.wait()
    if failed is not None:
        failed.wait()  # raises its error (a fresh copy, with this thread's traceback)


#: torch's own, as they were before any switch (the switch puts the two below in their place)
_TORCH_WAIT_ALL = torch.futures.wait_all
_TORCH_COLLECT_ALL = torch.futures.collect_all


def futures_wait_all(futures: list[torch.futures.Future[Any]]) -> list[Any]:
    """``torch.futures.wait_all`` under the switch: with distgrad futures among ``futures``,
    the first one to fail ends the wait with its error, as torch's does with its own (torch's
    C++ wait cannot see a pure-Python future's failure); otherwise torch's function."""
    futures = list(futures)
    if not any(isinstance(f, RpcFuture) for f in futures):
        return _TORCH_WAIT_ALL(futures)
    _wait_until_all_or_one_failed(futures)
    return [f.wait() for f in futures]


def futures_collect_all(
    futures: list[torch.futures.Future[Any]],
) -> torch.futures.Future[list[torch.futures.Future[Any]]]:
    """``torch.futures.collect_all`` under the switch: the combined future fails as soon as
    one of the distgrad futures among ``futures`` fails (with its error), and completes with
    the list once all have; otherwise torch's function."""
    futures = list(futures)
    if not any(isinstance(f, RpcFuture) for f in futures):
        return _TORCH_COLLECT_ALL(futures)
    combined: Any = RpcFuture()
    combined._pools = next((f._pools for f in futures if isinstance(f, RpcFuture)), ())
    lock = threading.Lock()
    left = [len(futures)]

    def done(future: torch.futures.Future[Any]) -> None:
        try:
            future.wait()
            error: BaseException | None = None
        except BaseException as exc:
            error = exc
        with lock:
            if combined.done():
                return
            left[0] -= 1
            if error is not None:
                combined.set_exception(error)
            elif left[0] == 0:
                combined.set_result(futures)

    if not futures:
        combined.set_result(futures)
    for future in futures:
        future.add_done_callback(done)
    return cast(torch.futures.Future[list[torch.futures.Future[Any]]], combined)


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
