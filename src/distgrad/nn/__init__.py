"""Drop-in replacement for ``torch.distributed.nn``: ``from distgrad.nn import RemoteModule``."""

from __future__ import annotations

# distgrad.rpc wires distributed autograd and the profiler into RPC (as torch's optim and nn
# import torch's rpc); the implementation below uses the private layers only.
from .. import rpc as _rpc  # noqa: F401
from .._nn._remote_module import RemoteModule

__all__ = ["RemoteModule"]

RemoteModule.__module__ = __name__
