"""``rref.rpc_sync()`` / ``rpc_async()`` / ``remote()`` proxies: call a method of the value on
its owner (torch's ``rref_proxy``).

``rref.rpc_sync().m(*a, **kw)`` is ``rpc_sync(rref.owner(), _local_invoke, (rref, "m", a, kw))``
(made through the agent, as ``rpc_sync`` / ``rpc_async`` / ``remote`` make it).
The value's type is looked up once (``rref._get_type``, cached) so that a method decorated with
``@rpc.functions.async_execution`` is run by the asynchronous invoker, as in the reference.

This module is below ``_rref`` (whose ``rpc_sync()`` / ``rpc_async()`` / ``remote()`` make
proxies), so it knows an RRef only through :class:`ProxyTarget`.
"""

from __future__ import annotations

import functools
from typing import Any, Protocol

import torch

from ..._errors import PeerFailureError
from .._core import WorkerInfo, async_execution, failed_future, require_agent, set_future_error

__all__ = ["ProxyTarget", "RRefProxy"]


class ProxyTarget(Protocol):
    """What a proxy uses of its RRef."""

    def owner(self) -> WorkerInfo: ...

    def local_value(self) -> Any: ...

    def _get_type(self, timeout: float = -1.0, blocking: bool = True) -> Any: ...

    def _remote_on_owner(self, func: Any, args: tuple[Any, ...], timeout: float) -> Any: ...


def _local_invoke(rref: ProxyTarget, func_name: str, args: Any, kwargs: Any) -> Any:
    return getattr(rref.local_value(), func_name)(*args, **kwargs)


@async_execution
def _local_invoke_async_execution(rref: ProxyTarget, func_name: str, args: Any, kwargs: Any) -> Any:
    return getattr(rref.local_value(), func_name)(*args, **kwargs)


def _invoker(rref_type: type, func_name: str) -> Any:
    if issubclass(rref_type, (torch.jit.ScriptModule, torch._C.ScriptModule)):
        return _local_invoke
    func = getattr(rref_type, func_name)  # AttributeError for an unknown method, as torch
    if hasattr(func, "_wrapped_async_rpc_function"):
        return _local_invoke_async_execution
    return _local_invoke


def _call(
    mode: str, rref: ProxyTarget, invoker: Any, call_args: tuple[Any, ...], timeout: float
) -> Any:
    """``rpc_sync`` / ``rpc_async`` / ``remote`` of ``invoker`` on the RRef's owner (a Python
    function: recorded by distributed autograd, as the public functions record it)."""
    if mode == "remote":
        return rref._remote_on_owner(invoker, call_args, timeout)
    agent = require_agent()
    if mode == "sync":
        return agent.call_sync(rref.owner(), invoker, call_args, {}, timeout, force=True)
    return agent.call_async(rref.owner(), invoker, call_args, {}, timeout, force=True)


def _invoke(
    rref: ProxyTarget, mode: str, func_name: str, timeout: float, *args: Any, **kwargs: Any
) -> Any:
    if mode != "async":
        type_future = rref._get_type(timeout=timeout, blocking=False)
        invoker = _invoker(type_future.wait(), func_name)
        return _call(mode, rref, invoker, (rref, func_name, args, kwargs), timeout)
    try:
        type_future = rref._get_type(timeout=timeout, blocking=False)
    except PeerFailureError as exc:  # an owner known dead fails the future (as rpc_async)
        return failed_future(exc)
    # rpc_async: the future of the method's result, whether the type is known yet or not
    result: torch.futures.Future[Any] = torch.futures.Future()

    def complete(done: torch.futures.Future[Any]) -> None:
        try:
            result.set_result(done.wait())
        except BaseException as exc:
            set_future_error(result, exc)

    def call(typed: torch.futures.Future[Any]) -> None:
        try:
            invoker = _invoker(typed.wait(), func_name)
            future = _call(mode, rref, invoker, (rref, func_name, args, kwargs), timeout)
        except BaseException as exc:
            set_future_error(result, exc)
            return
        future.add_done_callback(complete)

    type_future.add_done_callback(call)
    return result


class RRefProxy:
    """Attribute access returns a function that runs that method of the value on its owner."""

    __slots__ = ("_mode", "_rref", "_timeout")

    def __init__(self, rref: ProxyTarget, mode: str, timeout: float) -> None:
        self._rref = rref
        self._mode = mode
        self._timeout = timeout

    def __getattr__(self, func_name: str) -> Any:
        return functools.partial(_invoke, self._rref, self._mode, func_name, self._timeout)

    def __repr__(self) -> str:
        return f"RRefProxy({self._rref}, {self._mode})"
