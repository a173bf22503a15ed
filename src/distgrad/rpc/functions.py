"""``distgrad.rpc.functions`` (as ``torch.distributed.rpc.functions``)."""

from .._rpc._core import async_execution

__all__ = ["async_execution"]
