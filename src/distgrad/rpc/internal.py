"""``distgrad.rpc.internal`` (as ``torch.distributed.rpc.internal``): the few plain names of
torch's module that code outside torch reads.

torch's ``serialize`` / ``deserialize`` and ``_internal_rpc_pickler`` are not here: they are
TensorPipe's message format, which distgrad does not use (its pickler is in ``_wire``).
"""

from __future__ import annotations

import collections
from enum import Enum

__all__ = ["PythonUDF", "RPCExecMode", "RemoteException"]


class RPCExecMode(Enum):
    """How a call was made (torch's names and values)."""

    SYNC = "sync"
    ASYNC = "async"
    ASYNC_JIT = "async_jit"
    REMOTE = "remote"


#: A Python call as torch's RPC describes it.
PythonUDF = collections.namedtuple("PythonUDF", ["func", "args", "kwargs"])
#: An exception raised by a remote call, as torch's RPC carries it.
RemoteException = collections.namedtuple("RemoteException", ["msg", "exception_type"])
