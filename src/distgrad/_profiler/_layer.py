"""The profiler as a layer of the RPC layer (``_rpc._core._layer``): it profiles calls made while
torch's profiler is enabled on the calling thread, and serves the callee's side.

torch's profiler classes are wrapped (``_torch_hooks``) only once profiling can be used: when
an agent starts (torch-style programs enable ``torch.autograd.profiler.profile`` themselves
while RPC runs) or a :class:`distgrad.profiler.profile` is made -- importing ``distgrad.rpc``
patches nothing in torch.
"""

from __future__ import annotations

from typing import ClassVar

from .._rpc._core import KeyScope, LayerAgent, RpcLayer, WorkerInfo, register_layer
from . import _callee, _caller, _torch_hooks
from ._keys import build_rpc_profiling_key, func_name

__all__ = ["ProfilingLayer", "register"]


class ProfilingLayer(RpcLayer):
    """Profiles RPCs made while torch's profiler is enabled on the calling thread: the hooks
    of the profiling role are this package's functions."""

    name: ClassVar[str] = "profiler"
    profiles_calls: ClassVar[bool] = True

    call_sync = staticmethod(_caller.call_sync)  # type: ignore[assignment]
    call_async = staticmethod(_caller.call_async)  # type: ignore[assignment]
    serve = staticmethod(_callee.serve)  # type: ignore[assignment]
    serve_async = staticmethod(_callee.serve_async)  # type: ignore[assignment]

    def key_scope(self, kind: str, func: object, me: WorkerInfo, dst: WorkerInfo) -> KeyScope:
        key = build_rpc_profiling_key(kind, func_name(func), me.name, dst.name)
        return _caller.ProfiledKeyScope(key)

    def on_agent_start(self, agent: LayerAgent) -> None:
        _torch_hooks.install()


def register() -> None:
    """Register the profiling layer with the RPC layer (idempotent)."""
    register_layer(ProfilingLayer())
