"""``rpc.remote()``'s creation call, both ends (SPEC 1.1, 4.1).

The caller makes the RRef (``_rref.create_remote``: a user, pending until the owner confirms
it; or, for a call to self, the owner's handle) and sends ``_remote_exec`` to the owner
(:func:`creation_call`), which registers the caller's fork, runs the function and answers once
the value -- or the error, which is the value's -- is set; :func:`after_creation` records the
outcome on the caller's RRef.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..._errors import InjectedFailureError, RpcTimeoutError
from .._core import (
    RpcAgent,
    WorkerInfo,
    async_execution,
    is_builtin,
    is_script,
    message_type,
    report_udf_error,
    set_future_error,
)
from .._core import profiling as _profiling
from ._rref_context import GloballyUniqueId, OwnerValue, RemoteCreation, RRefContext, context_of
from ._rref_owner import _agent_or_raise, _done_future
from ._rref_values import UserHandle

__all__ = ["create_here", "create_there"]

#: ``(func, args, kwargs)`` of a ``remote()`` call
Call = tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]


def create_here(
    agent: RpcAgent,
    ctx: RRefContext,
    dst: WorkerInfo,
    rref_id: GloballyUniqueId,
    value: OwnerValue,
    call: Call,
    timeout: float,
    force: bool,
) -> torch.futures.Future[Any]:
    """``remote()`` to this worker itself: the owner's handle is made at once, the value by a
    real call to self. The call's own fork (the RRef id) keeps the value registered until the
    call is done. Returns the creation future of the RRef."""
    ctx.keep_owner(rref_id, value)
    ctx.add_fork(rref_id, rref_id)
    func = call[0]
    try:
        future = creation_call(
            agent, dst, func, (RemoteCreation(rref_id, rref_id), *call), timeout, force
        )
    except BaseException:
        ctx.del_forks([(rref_id, rref_id)])
        raise

    def created_here(error: BaseException | None) -> None:
        if isinstance(error, (RpcTimeoutError, InjectedFailureError)):  # as torch does
            value.timed_out = True
        elif error is not None:
            value.set_error(error)
        ctx.del_forks([(rref_id, rref_id)])

    return after_creation(future, created_here)


def create_there(
    agent: RpcAgent,
    ctx: RRefContext,
    dst: WorkerInfo,
    rref: UserHandle,
    call: Call,
    timeout: float,
    force: bool,
) -> torch.futures.Future[Any]:
    """``remote()`` to another worker: the user ``rref`` is pending until the owner confirms
    it (its creation call's answer). Returns the creation future of the RRef."""
    fork_id = rref._fork_id
    assert fork_id is not None
    ctx.add_pending_user(fork_id, rref)
    creation = RemoteCreation(rref._rref_id, fork_id)
    try:
        future = creation_call(agent, dst, call[0], (creation, *call), timeout, force)
    except BaseException as exc:  # not sent (a dead or unreachable owner): nobody will confirm
        ctx.confirm_user(fork_id, exc)
        raise
    return after_creation(future, lambda error: ctx.confirm_user(fork_id, error))


def creation_call(
    agent: RpcAgent,
    dst: WorkerInfo,
    func: Any,
    args: tuple[Any, ...],
    timeout: float,
    force: bool,
) -> torch.futures.Future[Any]:
    """The creation call of ``remote``; under a profiler it is the ``rpc_remote#...`` range,
    which ends when the creation is answered."""
    with _profiling.key_scope("remote", func, agent.worker_info, dst) as scope:
        future = agent.call_async(dst, _remote_exec, args, {}, timeout, force=force)
        scope.end_on(future)
    return future


def after_creation(
    future: torch.futures.Future[Any], settle: Callable[[BaseException | None], None]
) -> torch.futures.Future[Any]:
    """The creation future ``_get_future()`` returns: it completes like ``future`` (error types
    kept, which ``then`` would lose), after ``settle`` recorded the outcome on the RRef."""
    creation: torch.futures.Future[Any] = torch.futures.Future()

    def done(answered: torch.futures.Future[Any]) -> None:
        error: BaseException | None = None
        try:
            answered.wait()
        except BaseException as exc:
            error = exc
        settle(error)
        if error is None:
            creation.set_result(None)
        else:
            set_future_error(creation, error)

    future.add_done_callback(done)
    return creation


def _remote_type(args: tuple[Any, ...]) -> tuple[str, object]:
    func = args[1]  # (creation, func, args, kwargs)
    return ("SCRIPT_REMOTE_CALL" if is_script(func) else "PYTHON_REMOTE_CALL"), func


@message_type(_remote_type)
@async_execution
def _remote_exec(
    creation: RemoteCreation,
    func: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> torch.futures.Future[None]:
    """Create the value of a ``remote()`` call; answered once it is set (or failed: the
    error is the value's, raised where it is used, as in the reference). A request that fails
    before this runs gives its error to the value too (``RRefContext.fail_creation``)."""
    ctx = context_of(_agent_or_raise())
    rref_id, fork_id = creation.rref_id, creation.fork_id
    value = ctx.get_or_create_owner(rref_id)
    if fork_id != rref_id:
        ctx.add_fork(rref_id, fork_id)
    try:
        if getattr(func, "_wrapped_async_rpc_function", None) is None:
            value.set_value(func(*args, **kwargs))
            return _done_future()
        result = func(*args, **kwargs)
        if not isinstance(result, (torch.futures.Future, torch._C.Future)):
            kind = type(result)
            raise RuntimeError(
                "Functions decorated with @rpc.async_function must return a "
                f"torch.futures.Future object, but got {kind.__module__}.{kind.__qualname__}"
            )
    except BaseException as exc:
        if not is_builtin(func):  # printed on the owner, as the reference's callee does
            report_udf_error(exc, str(_agent_or_raise().worker_info))
        value.set_error(exc)
        return _done_future()
    replied: torch.futures.Future[None] = torch.futures.Future()

    def finish(done: torch.futures.Future[Any]) -> None:
        try:
            value.set_value(done.wait())
        except BaseException as exc:
            value.set_error(exc)
        replied.set_result(None)

    result.add_done_callback(finish)
    return replied
