"""The profiler as the RPC layer's call hook (``_rpc._profiling.CallProfiler``)."""

from __future__ import annotations

from typing import Any

from .._rpc import _profiling
from .._rpc._profiling import KeyScope
from .._rpc._worker_info import WorkerInfo
from . import _callee, _caller, _torch_hooks
from ._keys import build_rpc_profiling_key, func_name

__all__ = ["RpcProfiling", "install"]


class RpcProfiling:
    """Profiles RPCs made while torch's profiler is enabled on the calling thread: the RPC
    layer's hook is this module's functions, under the names the hook protocol uses."""

    call_sync = staticmethod(_caller.call_sync)
    call_async = staticmethod(_caller.call_async)
    serve = staticmethod(_callee.serve)
    serve_async = staticmethod(_callee.serve_async)

    @staticmethod
    def key_scope(kind: str, func: Any, me: WorkerInfo, dst: WorkerInfo) -> KeyScope:
        key = build_rpc_profiling_key(kind, func_name(func), me.name, dst.name)
        return _caller.ProfiledKeyScope(key)


def install() -> None:
    """Install the hook into the RPC layer and into torch's profilers (idempotent)."""
    if not isinstance(_profiling.get_profiler(), RpcProfiling):
        _profiling.set_profiler(RpcProfiling())
    _torch_hooks.install()
