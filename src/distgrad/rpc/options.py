"""``distgrad.rpc.options`` (as ``torch.distributed.rpc.options``): the backend options."""

from __future__ import annotations

from .._rpc._core import RpcBackendOptions, TensorPipeRpcBackendOptions

__all__ = ["RpcBackendOptions", "TensorPipeRpcBackendOptions"]
