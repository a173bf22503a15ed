"""torch's ``torch.distributed.rpc._testing``: importing it registers the fault-injecting backend
``FAULTY_TENSORPIPE``, whose options are :class:`FaultyTensorPipeRpcBackendOptions`.

distgrad's richer fault injection (drop, duplicate, reorder, sever, freeze; in-memory worlds)
is :mod:`distgrad.testing`; see docs/testing-fault-tolerance.md.
"""

from __future__ import annotations

from ..._rpc._core import FaultyTensorPipeRpcBackendOptions, register_faulty_backend

__all__ = ["FaultyTensorPipeRpcBackendOptions", "is_available"]


def is_available() -> bool:
    """Always True: fault injection needs nothing beyond distgrad."""
    return True


register_faulty_backend()
FaultyTensorPipeRpcBackendOptions.__module__ = __name__
