"""torch's ``torch.distributed.rpc.backend_registry``: the registered backends.

``BackendType`` is looked up when read, so a backend registered later (``FAULTY_TENSORPIPE``,
by importing ``distgrad.rpc._testing``) is a member of the ``BackendType`` read after it.
"""

from __future__ import annotations

from typing import Any

from .._rpc._core import (
    BackendValue,
    backend_registered,
    construct_rpc_backend_options,
    register_backend,
)
from .._rpc._core import backend_type as _backend_type

__all__ = [
    "BackendType",  # noqa: F822  (module __getattr__)
    "BackendValue",
    "backend_registered",
    "construct_rpc_backend_options",
    "register_backend",
]


def __getattr__(name: str) -> Any:
    if name == "BackendType":
        return _backend_type()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
