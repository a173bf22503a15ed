"""``distgrad.rpc.internal`` (as ``torch.distributed.rpc.internal``): the pieces of torch's
RPC internals that programs call, and the plain names code outside torch reads.

``serialize`` / ``deserialize`` pickle an object the way a call's arguments are pickled: RRefs
in it are forked (so the stream must be deserialized on exactly one worker of the group, as
with torch's), tensors travel in a separate table. The stream is distgrad's, not torch's: only
distgrad reads it. ``_build_rpc_profiling_key`` names a profiled call as torch's does.

``_InternalRPCPickler`` / ``_internal_rpc_pickler`` have torch's names and shape, for code that
chooses its pickler through ``rpc.api._use_rpc_pickler``: a subclass picks the underlying
pickle library by overriding ``_pickler(f)`` / ``_unpickler(f)`` (as proposed upstream in
pytorch/pytorch#153808; dill, say). distgrad's messages are its own format, so a subclass that
overrides ``serialize`` / ``deserialize`` instead is refused with a clear error.
"""

from __future__ import annotations

import collections
import io
import pickle
from typing import Any

import torch

from .._profiler._keys import RPCExecMode, build_rpc_profiling_key
from .._wire._pickler import deserialize_with_table, serialize_with_table

__all__ = ["PythonUDF", "RPCExecMode", "RemoteException", "deserialize", "serialize"]

#: the pickle library's classes torch's module exposes (``internal._pickler``)
_pickler = pickle.Pickler
_unpickler = pickle.Unpickler

#: A Python call as torch's RPC describes it.
PythonUDF = collections.namedtuple("PythonUDF", ["func", "args", "kwargs"])
#: An exception raised by a remote call, as torch's RPC carries it.
RemoteException = collections.namedtuple("RemoteException", ["msg", "exception_type"])


def serialize(obj: Any) -> tuple[bytes, list[torch.Tensor]]:
    """Pickle ``obj`` as an RPC argument is pickled (torch's ``internal.serialize``).

    Args:
        obj: any picklable object; RRefs in it are forked for the receiver.

    Returns:
        tuple: the pickle stream (``bytes``) and the list of tensors it refers to.

    Raises:
        RuntimeError: an RRef in ``obj`` cannot be forked (its creation timed out, or it was
            deleted).
    """
    return serialize_with_table(obj)


def deserialize(binary_data: bytes, tensor_table: list[torch.Tensor]) -> Any:
    """The object :func:`serialize` returned ``(binary_data, tensor_table)`` for (torch's
    ``internal.deserialize``); RRefs in it become this worker's references.

    Args:
        binary_data (bytes): the stream.
        tensor_table (list[Tensor]): its tensors.

    Returns:
        The object.
    """
    return deserialize_with_table(binary_data, tensor_table)


_build_rpc_profiling_key = build_rpc_profiling_key


class _InternalRPCPickler:
    """torch's RPC pickler by its shape: :meth:`serialize` / :meth:`deserialize` an object as
    ``(bytes, tensors)``, and the pickle library it uses (``_pickler(f)`` / ``_unpickler(f)``),
    which a subclass may override -- passing an instance of it to
    ``rpc.api._use_rpc_pickler`` then makes distgrad pickle its messages with that library."""

    def _pickler(self, f: io.BytesIO) -> pickle.Pickler:
        """The pickler of the library (default: ``pickle``) writing to ``f``."""
        return _pickler(f)

    def _unpickler(self, f: io.BytesIO) -> pickle.Unpickler:
        """The unpickler of the library (default: ``pickle``) reading ``f``."""
        return _unpickler(f)

    def serialize(self, obj: Any) -> tuple[bytes, list[torch.Tensor]]:
        """:func:`serialize`."""
        return serialize_with_table(obj)

    def deserialize(self, binary_data: bytes, tensor_table: list[torch.Tensor]) -> Any:
        """:func:`deserialize`."""
        return deserialize_with_table(binary_data, tensor_table)


#: the default pickler (``rpc.api._use_rpc_pickler`` restores it)
_internal_rpc_pickler = _InternalRPCPickler()
