"""``torch.distributed.nn.api.remote_module``'s path:
``from distgrad.nn.api.remote_module import RemoteModule``."""

from __future__ import annotations

from ..._nn._remote_module import RemoteModule

__all__ = ["RemoteModule"]
