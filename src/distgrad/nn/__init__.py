"""Drop-in replacement for ``torch.distributed.nn``: ``from distgrad.nn import RemoteModule``."""

from __future__ import annotations

from .._nn._remote_module import RemoteModule

__all__ = ["RemoteModule"]

RemoteModule.__module__ = __name__
