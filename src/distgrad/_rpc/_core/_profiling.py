"""The hook through which profiling (layer 5) rides along with calls.

``distgrad.profiler`` registers an :class:`~._layer.RpcLayer` that profiles calls
(``profiles_calls``); the RPC layer never imports it. The call path pays one check,
:func:`wants`: is such a layer registered *and* is torch's profiler enabled on this thread
(``torch.autograd._profiler_enabled()``, a C call of about 0.1 us). When it is not, nothing
else happens: no ``record_function``, no extra pickling, the request carries no profiling flag.

When it is, the agent hands the call to the profiler, which re-issues it through the same
agent method as a call of :func:`serve` (or :func:`serve_async`) with the original function as
an argument: the *request is the flag*. The callee runs it under a thread-local profiler and
answers ``(result, remote profile)``; the caller's profiler unwraps the result and keeps the
remote events.

:func:`key_scope` lets an API above the agent name its call itself (``rpc.remote`` records
``rpc_remote#...`` and the creation call it makes inherits that key)::

    with _profiling.key_scope("remote", func, dst) as scope:
        future = agent.call_async(dst, ...)
        scope.end_on(future)  # the range ends when the future completes (else at block exit)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from . import _layer
from ._functions import async_execution
from ._layer import KeyScope, RpcLayer
from ._messages import message_type
from ._worker_info import WorkerInfo

__all__ = [
    "KeyScope",
    "call_async",
    "call_sync",
    "key_scope",
    "serve",
    "serve_async",
    "serving_wrapper",
    "wants",
]

_autograd: Any = torch.autograd
_profiler_enabled: Callable[[], bool] = _autograd._profiler_enabled


_NO_SCOPE = KeyScope()

#: While an ``rpc._server_process_global_profile`` is open on this worker (``distgrad.profiler``
#: sets it): wraps the function of a request being served so that it runs profiled. The
#: serving path reads it once per request; ``None`` costs nothing more.
serving_wrapper: Callable[[Callable[..., Any]], Callable[..., Any]] | None = None


def wants(func: object) -> bool:
    """The one check on the call path: should this call be profiled?"""
    return (
        _layer._profiler is not None  # (the registry's field: no call on the call path)
        and _profiler_enabled()
        and func is not serve
        and func is not serve_async
    )


def _require() -> RpcLayer:
    profiler = _layer.call_profiler()
    if profiler is None:  # a profiled request reached a worker without distgrad.profiler
        raise RuntimeError("distgrad.profiler is not installed on this worker")
    return profiler


def _profiled_type(args: tuple[Any, ...]) -> tuple[str, object]:
    return "RUN_WITH_PROFILING_REQ", args[1]


@message_type(_profiled_type)
def serve(request: Any, func: Any, args: Any, kwargs: Any) -> Any:
    """What a profiled request calls on the callee (see the module docstring)."""
    return _require().serve(request, func, args, kwargs)


@message_type(_profiled_type)
@async_execution
def serve_async(request: Any, func: Any, args: Any, kwargs: Any) -> torch.futures.Future[Any]:
    """:func:`serve` for ``@async_execution`` functions."""
    return _require().serve_async(request, func, args, kwargs)


def key_scope(kind: str, func: Any, me: WorkerInfo, dst: WorkerInfo) -> KeyScope:
    """A ``rpc_{kind}#...`` range for a call made by an API above the agent (``remote``):
    inside it, the next profiled call on this thread is recorded under that key instead of
    its own. A no-op object when not profiling (one check)."""
    profiler = _layer.call_profiler()
    if profiler is None or not _profiler_enabled():
        return _NO_SCOPE
    return profiler.key_scope(kind, func, me, dst)


def call_sync(
    send: Callable[..., Any],
    me: WorkerInfo,
    dst: WorkerInfo,
    func: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    timeout: float,
    force: bool,
    internal: bool,
) -> Any:
    """The agent's ``call_sync`` when :func:`wants` said yes."""
    return _require().call_sync(send, me, dst, func, args, kwargs, timeout, force, internal)


def call_async(
    send: Callable[..., torch.futures.Future[Any]],
    me: WorkerInfo,
    dst: WorkerInfo,
    func: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    timeout: float,
    force: bool,
    internal: bool,
) -> torch.futures.Future[Any]:
    """The agent's ``call_async`` when :func:`wants` said yes."""
    return _require().call_async(send, me, dst, func, args, kwargs, timeout, force, internal)
