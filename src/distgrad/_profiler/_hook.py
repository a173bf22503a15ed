"""The profiler as the RPC layer's call hook (``_rpc._profiling.CallProfiler``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .._rpc import _profiling
from .._rpc._profiling import KeyScope
from .._rpc._worker_info import WorkerInfo
from . import _callee, _caller, _torch_hooks
from ._keys import build_rpc_profiling_key, func_name

__all__ = ["RpcProfiling", "install"]


class RpcProfiling:
    """Profiles RPCs made while torch's profiler is enabled on the calling thread."""

    def call_sync(
        self,
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
        return _caller.call_sync(send, me, dst, func, args, kwargs, timeout, force, internal)

    def call_async(
        self,
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
        return _caller.call_async(send, me, dst, func, args, kwargs, timeout, force, internal)

    def serve(self, request: Any, func: Any, args: Any, kwargs: Any) -> Any:
        return _callee.serve(request, func, args, kwargs)

    def serve_async(
        self, request: Any, func: Any, args: Any, kwargs: Any
    ) -> torch.futures.Future[Any]:
        return _callee.serve_async(request, func, args, kwargs)

    def key_scope(self, kind: str, func: Any, me: WorkerInfo, dst: WorkerInfo) -> KeyScope:
        key = build_rpc_profiling_key(kind, func_name(func), me.name, dst.name)
        return _caller.ProfiledKeyScope(key)


def install() -> None:
    """Install the hook into the RPC layer and into torch's profilers (idempotent)."""
    if not isinstance(_profiling.get_profiler(), RpcProfiling):
        _profiling.set_profiler(RpcProfiling())
    _torch_hooks.install()
