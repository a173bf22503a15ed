"""TorchScript functions as RPC targets: sent by qualified name, as torch's RPC sends them.

A ``torch.jit.ScriptFunction`` cannot be pickled. In a message it travels as its qualified
name (``__torch__.<module>.<name>``); the receiver takes the function of that name from its
own TorchScript compilation unit, after importing the module named in it if the function is
not compiled there yet -- so, as with Python functions, the callee must have the module. The
callee then calls it as Python would, and its errors arrive with their bare message, as a
builtin operator's do.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

import torch

from ..._wire._pickler import register_reducer

__all__ = [
    "SCRIPT_TARGETS",
    "AsyncScriptFunction",
    "ScriptFunction",
    "as_rpc_target",
    "is_script_function",
    "rref_limit",
]

ScriptFunction: Any = torch.jit.ScriptFunction
_PREFIX = "__torch__."


class AsyncScriptFunction:
    """What travels for ``@async_execution`` over ``@torch.jit.script``: the ScriptFunction
    (by its name), marked as returning a future. The decorator's wrapper cannot be pickled by
    reference (``functools.wraps`` gives it the ScriptFunction's names), and torch's RPC
    too sends the ScriptFunction itself with an "async" flag."""

    def __init__(self, function: Any) -> None:
        self.function = function
        self._wrapped_async_rpc_function = function
        self.__qualname__ = str(function.qualified_name)  # names its profiling events

    @property
    def qualified_name(self) -> str:
        return str(self.function.qualified_name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.function(*args, **kwargs)


#: the types an RPC target has when it is TorchScript
SCRIPT_TARGETS = frozenset({ScriptFunction, AsyncScriptFunction})


def rref_limit(what: str) -> NotImplementedError:
    """The one error for TorchScript meeting distgrad's RRefs, which it cannot take: its
    ``RRef[T]`` type is torch's C++ RRef, which exists only under torch's own RPC agent."""
    return NotImplementedError(
        f"{what}: TorchScript cannot take distgrad RRefs (RRef[T] parameters and TorchScript "
        "RemoteModules need torch's own RPC agent, which distgrad replaces). Call a Python "
        "function instead; it may pass rref.to_here() (the value) to the TorchScript function. "
        "See docs/migration.md."
    )


def as_rpc_target(func: Any) -> Any:
    """``func`` as it is sent: an ``@async_execution`` ScriptFunction becomes an
    :class:`AsyncScriptFunction`; everything else is itself."""
    wrapped = getattr(func, "_wrapped_async_rpc_function", None)
    if isinstance(wrapped, ScriptFunction) and not isinstance(func, AsyncScriptFunction):
        return AsyncScriptFunction(wrapped)
    return func


def is_script_function(func: object) -> bool:
    """True for a TorchScript function (also one marked ``@async_execution``)."""
    return isinstance(func, (ScriptFunction, AsyncScriptFunction))


def _compiled(qualified_name: str) -> Any:
    cu: Any = torch.jit._state._python_cu  # type: ignore[attr-defined]
    return cu.find_function(qualified_name)


def script_function(qualified_name: str) -> Any:
    """The receiving side: the ScriptFunction named ``qualified_name`` in this process.

    Raises ``AttributeError`` (reported to the caller as a function missing on the callee)
    when neither the compilation unit nor the module named in the name has it."""
    found = _compiled(qualified_name)
    if found is not None:
        return found
    path = qualified_name.removeprefix(_PREFIX)
    module_name, _, attribute = path.rpartition(".")
    candidates = [module_name] if module_name else []
    candidates.append("__main__")  # functions of a script's main module are __torch__.<name>
    for candidate in candidates:
        try:
            module = sys.modules.get(candidate) or importlib.import_module(candidate)
        except ImportError:
            continue
        value = getattr(module, attribute, None)
        found = _compiled(qualified_name)  # importing the module compiled it
        if found is not None:
            return found
        if isinstance(value, ScriptFunction):
            return value
    raise AttributeError(
        f"TorchScript function {qualified_name} is not defined on this worker: script it in "
        "a module that this worker imports too (or send a Python function instead)"
    )


def _reduce_script_function(func: Any) -> tuple[Any, tuple[str]]:
    return script_function, (str(func.qualified_name),)


register_reducer(ScriptFunction, _reduce_script_function)
