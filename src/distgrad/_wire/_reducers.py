"""How a tensor of a message is reduced for the tensor-aware pickler (``_pickler``).

The table stream's reducers: a dense CPU tensor as one out-of-band buffer of its bytes; a view,
slice or lazy conjugate/negative tensor by torch's rule (cloned, or sent with its whole storage,
strides and offset kept, views of one storage sharing one buffer); sparse COO as its indices and
values; a tensor off the CPU as its device map routes it. ``_policy`` is the device policy and
shared-storage memo of the dump in progress on this thread, set by ``_pickler``.
"""

from __future__ import annotations

import pickle
import threading
from collections.abc import Callable
from typing import Any

import torch

from .._errors import DistgradError
from ._buffers import (
    _CODE_OF_DTYPE,
    _CONJ,
    _NEG,
    _STRIDED,
    _rebuild_array,
    _rebuild_array_grad,
    _rebuild_sparse_coo,
    _rebuild_storage,
    _rebuild_view,
    _storage_bytes,
)

#: torch's ``kMinRecopyBytes``: a view of a storage this large (and twice its bytes) is cloned
_RECOPY_BYTES = 8 * 1024


DeviceCheck = Callable[[torch.Tensor], Any]
"""What routes a tensor of a message by the device maps: called with every tensor not on the
CPU -- and with CPU tensors too when it has a true ``routes_cpu`` attribute (a map with a
``cpu`` entry) -- it returns ``None`` (send the tensor as it is, a CPU tensor) or the
reduction that sends it (its host bytes and the device it lands on), or raises."""


# The device policy of the dump in progress on this thread (set by ``dumps``); the reducers are
# plain functions in a class-level dispatch table, so they find it here.
class _Policy(threading.local):
    device_check: DeviceCheck | None = None
    table: list[torch.Tensor] | None = None
    #: storage address -> what carries its bytes in the dump in progress (see _reduce_view)
    storages: dict[int, Any] | None = None
    #: ids of the host tensors inside routed reductions (a routing pickler's dump in progress)
    staged: set[int] | None = None


_policy = _Policy()


def _reduce_future(_future: Any) -> Any:
    raise DistgradError("Can not pickle torch.futures.Future")


def _reduce_tensor(tensor: torch.Tensor) -> Any:
    # Fast path (most messages): a dense contiguous CPU tensor that numpy can view directly.
    # (``numpy()`` refuses a tensor with a conjugate or negative bit: the general path below
    # keeps those bits; and one that requires grad, hence the ``detach``.)
    code = _CODE_OF_DTYPE.get(tensor.dtype)
    if (
        code is not None
        and tensor.layout is _STRIDED
        and tensor.is_cpu
        and not tensor.is_nested
        and tensor.is_contiguous()
        # exactly its storage (so offset 0): a slice goes by torch's rule (_reduce_view)
        and tensor.untyped_storage().nbytes() == tensor.nbytes
    ):
        requires_grad = tensor.requires_grad
        try:
            array = (tensor.detach() if requires_grad else tensor).numpy()
        except (RuntimeError, TypeError):  # anything numpy can't view takes the general path
            pass
        else:
            shared = _policy.storages
            if shared is not None and array.nbytes:  # another tensor of the message views it?
                address = tensor.data_ptr()
                first = shared.get(address)
                if first is not None:
                    return _view_of(first, tensor, code, requires_grad)
                shared[address] = tensor  # (the pickler's memo keeps it: views refer to it)
            return (
                _rebuild_array_grad if requires_grad else _rebuild_array,
                (pickle.PickleBuffer(array), code, array.shape),  # type: ignore[arg-type]
            )
    requires_grad = tensor.requires_grad
    if tensor.device.type != "cpu":
        device_check = _policy.device_check
        if device_check is None:
            return tensor.__reduce_ex__(5)  # type: ignore[no-untyped-call]
        routed = device_check(tensor)
        if routed is not None:
            staged = _policy.staged
            if staged is not None:  # a routing pickler: its host tensors go as they are
                staged.update(id(arg) for arg in routed[1] if isinstance(arg, torch.Tensor))
            return routed
    if tensor.layout != torch.strided and (tensor.is_conj() or tensor.is_neg()):
        tensor = tensor.resolve_conj().resolve_neg()  # (a strided one keeps its bits)
    if tensor.layout == torch.sparse_coo:
        # indices and values are dense tensors: they come back through this table
        return (
            _rebuild_sparse_coo,
            (
                tensor._indices().detach(),
                tensor._values().detach(),
                tuple(tensor.shape),
                tensor.is_coalesced(),
                requires_grad,
            ),
        )
    if tensor.layout != torch.strided or tensor.is_quantized or tensor.is_nested:
        return tensor.__reduce_ex__(5)  # type: ignore[no-untyped-call]
    return _reduce_view(tensor.detach(), code, requires_grad)


def _reduce_view(tensor: torch.Tensor, code: int | None, requires_grad: bool) -> Any:
    """A strided tensor that does not own exactly its storage (a view, a slice, an offset):
    torch's rule (``cloneSparseTensors`` in torch/csrc/distributed/rpc/utils.cpp) -- cloned
    when its storage is at least 8 KiB and at least twice the bytes it uses, else sent with
    its whole storage, strides and offset kept. Views of one storage in one message share one
    buffer (and so one storage on arrival), as torch's."""
    storage = tensor.untyped_storage()
    nbytes = storage.nbytes()
    if nbytes >= _RECOPY_BYTES and nbytes >= 2 * tensor.numel() * tensor.element_size():
        # (torch's: the layout is kept where it is dense; lazy conjugate/negative bits resolved)
        tensor = tensor.clone()
        storage = tensor.untyped_storage()
        nbytes = storage.nbytes()
    shared = _policy.storages
    key = storage.data_ptr()
    first = shared.get(key) if shared is not None and nbytes else None
    if first is None:
        first = _Storage(_storage_bytes(storage, nbytes))
        if shared is not None and nbytes:
            shared[key] = first
    return _view_of(first, tensor, code, requires_grad)


def _view_of(
    first: _Storage | torch.Tensor, tensor: torch.Tensor, code: int | None, requires_grad: bool
) -> Any:
    """``tensor`` as a view of the storage that ``first`` carries in this message: the
    storage's bytes, or a tensor (owning its storage exactly) pickled earlier in it. A lazy
    conjugate or negative view keeps its bit (the storage holds the unconjugated values)."""
    args = (
        first,
        tensor.dtype if code is None else code,
        tuple(tensor.shape),
        tuple(tensor.stride()),
        tensor.storage_offset(),
        requires_grad,
    )
    bits = (_CONJ if tensor.is_conj() else 0) | (_NEG if tensor.is_neg() else 0)
    return (_rebuild_view, (*args, bits) if bits else args)


class _Storage:
    """The bytes of one storage in the message being pickled: pickled once (the pickler's memo
    keeps the object), however many tensors of the message view it."""

    __slots__ = ("buffer",)

    def __init__(self, buffer: memoryview) -> None:
        self.buffer = buffer


def _reduce_storage(holder: _Storage) -> Any:
    return (_rebuild_storage, (pickle.PickleBuffer(holder.buffer),))


def _reduce_routed_tensor(tensor: torch.Tensor) -> Any:
    """A tensor of a message whose device map routes CPU tensors too (a ``cpu`` entry): every
    tensor asks the map first. Only such messages use it; the others keep the fast path.
    The host tensors inside a routed reduction go as they are (``_policy.staged``)."""
    if tensor.device.type == "cpu":
        staged = _policy.staged
        check = _policy.device_check
        assert staged is not None and check is not None  # (set by the routing dump)
        if id(tensor) in staged:
            return _reduce_tensor(tensor)
        routed = check(tensor)
        if routed is not None:
            staged.update(id(arg) for arg in routed[1] if isinstance(arg, torch.Tensor))
            return routed
    return _reduce_tensor(tensor)
