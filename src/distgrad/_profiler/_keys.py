"""Event keys of profiled RPCs, as the reference names them (SPEC 3).

A call is recorded as a range named ``rpc_{mode}#{func_name}({caller} -> {callee})``; an
event the callee recorded for it appears on the caller as ``key + "#remote_op: " + name``
(nested calls nest: ``key0#remote_op: key1#remote_op: aten::add``).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

import torch
from torch.jit._builtins import _find_builtin as _find_builtin_untyped

__all__ = ["REMOTE_OP", "RPCExecMode", "build_rpc_profiling_key", "func_name", "remote_name"]

REMOTE_OP = "#remote_op: "

_find_builtin: Callable[[Any], Any] = _find_builtin_untyped


class RPCExecMode(enum.Enum):
    """The kinds of profiled call (torch's ``torch.distributed.rpc.internal.RPCExecMode``)."""

    SYNC = "sync"
    ASYNC = "async"
    ASYNC_JIT = "async_jit"
    REMOTE = "remote"


def build_rpc_profiling_key(
    exec_type: RPCExecMode | str, func_name: str, current_worker_name: str, dst_worker_name: str
) -> str:
    """The name a call is profiled under (torch's ``internal._build_rpc_profiling_key``)."""
    mode = exec_type.value if isinstance(exec_type, RPCExecMode) else str(exec_type)
    return f"rpc_{mode}#{func_name}({current_worker_name} -> {dst_worker_name})"


def func_name(func: Any) -> str:
    """``aten::add`` for torch operators, a TorchScript function's qualified name, else the
    Python ``__qualname__``."""
    try:
        builtin = _find_builtin(func)
    except Exception:
        builtin = None
    if builtin is not None:
        return str(builtin)
    if isinstance(func, torch.jit.ScriptFunction):
        return str(func.qualified_name)
    name = getattr(func, "__qualname__", None)
    return str(name) if name is not None else type(func).__qualname__


def remote_name(key: str, name: str) -> str:
    """The caller's name for an event ``name`` the callee recorded for the call ``key``."""
    return key + REMOTE_OP + name
