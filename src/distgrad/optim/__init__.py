"""Drop-in replacement for ``torch.distributed.optim``:
``from distgrad.optim import DistributedOptimizer``."""

from __future__ import annotations

from .._optim._optimizer import DistributedOptimizer

__all__ = ["DistributedOptimizer"]

DistributedOptimizer.__module__ = __name__
