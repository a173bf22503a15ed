"""``rref.rpc_sync()`` / ``rpc_async()`` / ``remote()`` proxies: call a method of the value on
its owner (torch's ``rref_proxy``).

``rref.rpc_sync().m(*a, **kw)`` is ``rpc_sync(rref.owner(), _local_invoke, (rref, "m", a, kw))``.
The value's type is looked up once (``rref._get_type``, cached) so that a method decorated with
``@rpc.functions.async_execution`` is run by the asynchronous invoker, as in the reference.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch

from .. import _api
from .._core._calls import set_future_error
from .._core._functions import async_execution

if TYPE_CHECKING:
    from ._rref import RRef

__all__ = ["RRefProxy"]


def _local_invoke(rref: RRef[Any], func_name: str, args: Any, kwargs: Any) -> Any:
    return getattr(rref.local_value(), func_name)(*args, **kwargs)


@async_execution
def _local_invoke_async_execution(rref: RRef[Any], func_name: str, args: Any, kwargs: Any) -> Any:
    return getattr(rref.local_value(), func_name)(*args, **kwargs)


def _invoker(rref_type: type, func_name: str) -> Any:
    if issubclass(rref_type, (torch.jit.ScriptModule, torch._C.ScriptModule)):
        return _local_invoke
    func = getattr(rref_type, func_name)  # AttributeError for an unknown method, as torch
    if hasattr(func, "_wrapped_async_rpc_function"):
        return _local_invoke_async_execution
    return _local_invoke


_APIS = {"sync": _api.rpc_sync, "async": _api.rpc_async, "remote": _api.remote}


def _invoke(
    rref: RRef[Any], mode: str, func_name: str, timeout: float, *args: Any, **kwargs: Any
) -> Any:
    api = _APIS[mode]
    type_future = rref._get_type(timeout=timeout, blocking=False)
    if mode != "async":
        invoker = _invoker(type_future.wait(), func_name)
        return api(rref.owner(), invoker, args=(rref, func_name, args, kwargs), timeout=timeout)
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
            future = api(
                rref.owner(), invoker, args=(rref, func_name, args, kwargs), timeout=timeout
            )
        except BaseException as exc:
            set_future_error(result, exc)
            return
        future.add_done_callback(complete)

    type_future.add_done_callback(call)
    return result


class RRefProxy:
    """Attribute access returns a function that runs that method of the value on its owner."""

    __slots__ = ("_mode", "_rref", "_timeout")

    def __init__(self, rref: RRef[Any], mode: str, timeout: float) -> None:
        self._rref = rref
        self._mode = mode
        self._timeout = timeout

    def __getattr__(self, func_name: str) -> Any:
        return functools.partial(_invoke, self._rref, self._mode, func_name, self._timeout)

    def __repr__(self) -> str:
        return f"RRefProxy({self._rref}, {self._mode})"
