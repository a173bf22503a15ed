"""Drop-in replacement for ``torch.distributed.optim``:
``from distgrad.optim import DistributedOptimizer``."""

from __future__ import annotations

# distgrad.rpc wires distributed autograd and the profiler into RPC (as torch's optim and nn
# import torch's rpc); the implementation below uses the private layers only.
from .. import rpc as _rpc  # noqa: F401
from .._optim._optimizer import DistributedOptimizer

__all__ = ["DistributedOptimizer"]

DistributedOptimizer.__module__ = __name__
