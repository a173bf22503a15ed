"""Tensor bytes on both ends of the wire: the storage bytes a tensor sends, the memory a
received buffer lands in (``allocate_buffer``), and the functions that rebuild a tensor around
a received buffer (what the pickle stream names); the small codes that stand for numpy dtypes."""

from __future__ import annotations

import mmap
from typing import Any

import numpy
import torch

from .._errors import ProtocolError

__all__ = ["allocate_buffer"]


def _storage_bytes(storage: torch.UntypedStorage, nbytes: int) -> memoryview:
    """A writable view of a storage's first ``nbytes`` bytes; it keeps the storage alive."""
    if nbytes == 0:
        return memoryview(b"")
    as_bytes = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (nbytes,), (1,))
    return memoryview(as_bytes.numpy())  # type: ignore[arg-type]


_HUGE_THRESHOLD = 32 * 1024 * 1024  # glibc serves smaller blocks from reused heap memory
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", None)


def allocate_buffer(nbytes: int) -> memoryview:
    """Uninitialised, writable memory for one received buffer.

    The memory is a numpy array, so any protocol-5 user (numpy itself) can take it as a plain
    buffer, while :func:`_rebuild_tensor` wraps it with ``torch.from_numpy`` -- the received
    tensor's storage *is* this memory.

    Large buffers are their own anonymous mapping with transparent huge pages requested:
    faulting in fresh 4 KiB pages costs more than receiving the bytes (measured: 30 ms vs
    8.5 ms for 64 MiB on the dev machines), and huge pages cut that cost to a few faults.
    """
    if nbytes >= _HUGE_THRESHOLD and _MADV_HUGEPAGE is not None:
        region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        try:
            region.madvise(_MADV_HUGEPAGE)
        except OSError:
            pass
        return memoryview(numpy.frombuffer(region, dtype=numpy.uint8))  # type: ignore[arg-type]
    return memoryview(numpy.empty(nbytes, dtype=numpy.uint8))  # type: ignore[arg-type]


def _buffer_array(buf: Any) -> numpy.ndarray:
    """The writable uint8 array of a received buffer (copying only foreign, read-only buffers)."""
    owner = buf.obj if isinstance(buf, memoryview) else None
    if isinstance(owner, numpy.ndarray) and owner.nbytes == buf.nbytes:
        buf = owner
    if isinstance(buf, numpy.ndarray) and buf.flags.writeable and buf.dtype == numpy.uint8:
        return buf
    raw = memoryview(buf).cast("B")
    return numpy.frombuffer(bytearray(raw), dtype=numpy.uint8)


def _buffer_tensor(buf: Any) -> torch.Tensor:
    """The uint8 tensor over a received buffer (copying only foreign, read-only buffers)."""
    array = _buffer_array(buf)
    if array.nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.from_numpy(array)


def _rebuild_storage(buf: Any) -> torch.Tensor:
    """The bytes of one sent storage, as a uint8 tensor over the received memory (the views
    of the message that share it are rebuilt on it by :func:`_rebuild_view`)."""
    return _buffer_tensor(buf)


#: the lazy bits a received view may carry (torch's conjugate and negative views)
_CONJ = 1
_NEG = 2
_set_conj: Any = torch._C._set_conj  # type: ignore[attr-defined]
_set_neg: Any = torch._C._set_neg  # type: ignore[attr-defined]

#: a received view's dimensions are bounded before any work is done on them
_MAX_DIMS = 1024


def _rebuild_view(
    storage: torch.Tensor,  # the message's bytes of the storage, or a tensor received on it
    dtype: int | torch.dtype,
    size: tuple[int, ...],
    stride: tuple[int, ...],
    offset: int,
    requires_grad: bool,
    bits: int = 0,
) -> torch.Tensor:
    """A tensor on a received storage with the sender's sizes, strides and storage offset,
    after checking that they stay inside that storage (a malformed or hostile frame must not
    make a view of memory it did not send); ``bits``: its lazy conjugate (``_CONJ``) and
    negative (``_NEG``) bits, as torch keeps them."""
    kind: Any = dtype
    if type(dtype) is int and 0 <= dtype < len(_TORCH_OF_CODE):
        kind = _TORCH_OF_CODE[dtype]
    if not isinstance(kind, torch.dtype):
        raise ProtocolError(f"received tensor has no valid dtype: {dtype!r}")
    untyped = storage.untyped_storage()
    _check_view(untyped.nbytes(), kind.itemsize, size, stride, offset)
    if type(bits) is not int or not 0 <= bits <= _CONJ | _NEG:
        raise ProtocolError(f"received tensor has invalid view bits: {bits!r}")
    tensor = torch.empty(0, dtype=kind).set_(untyped, offset, size, stride)
    if bits:
        if bits & _CONJ and not kind.is_complex:
            raise ProtocolError(f"received tensor of {kind} is marked conjugate")
        _set_conj(tensor, bool(bits & _CONJ))
        _set_neg(tensor, bool(bits & _NEG))
    if requires_grad:
        tensor.requires_grad_(True)
    return tensor


def _check_view(nbytes: int, itemsize: int, size: Any, stride: Any, offset: Any) -> None:
    """Raise :class:`ProtocolError` unless ``size``/``stride``/``offset`` (from the wire) are
    non-negative integers describing a view inside ``nbytes`` bytes of elements of
    ``itemsize`` bytes."""
    if (
        type(size) is not tuple
        or type(stride) is not tuple
        or len(size) != len(stride)
        or len(size) > _MAX_DIMS
        or type(offset) is not int
        or offset < 0
        or any(type(n) is not int or n < 0 for n in size)
        or any(type(s) is not int or s < 0 for s in stride)
    ):
        raise ProtocolError(
            f"received tensor view is malformed: size {size!r}, stride {stride!r}, "
            f"offset {offset!r}"
        )
    end = offset
    if 0 not in size:
        end += 1 + sum((n - 1) * s for n, s in zip(size, stride, strict=True))
    if end * itemsize > nbytes:
        raise ProtocolError(
            f"received tensor view (size {size}, stride {stride}, offset {offset}) reaches past "
            f"its storage of {nbytes} bytes"
        )


def _rebuild_array(buf: Any, code: int, size: tuple[int, ...]) -> torch.Tensor:
    """A contiguous tensor of a numpy dtype (the common case) over the received bytes.

    A received buffer (a writable memoryview of :func:`allocate_buffer`'s memory) is taken
    by ``torch.frombuffer`` -- one torch call, whose tensor keeps the memoryview (and so the
    memory) alive. Only a 1-D tensor goes this way (others would be views of it, and a
    received tensor is no view of a helper tensor). What a message pays here is mostly cold
    code after the thread's wake-up, not the work: measured after a 0.2 ms sleep, 1 KiB,
    median, this took 10-16 µs through numpy (``view``, ``reshape``, ``torch.from_numpy``)
    and 6-8 µs this way. Anything else (another shape, a foreign, borrowed or read-only
    buffer, no bytes) goes through numpy as before (which copies what is not such memory)."""
    if (
        type(buf) is memoryview
        and type(buf.obj) is numpy.ndarray  # (memory of allocate_buffer's, never borrowed)
        and buf.obj.nbytes == buf.nbytes
        and buf.nbytes
        and not buf.readonly
        and buf.c_contiguous
        and len(size) == 1
        and size[0] * _TORCH_OF_CODE[code].itemsize == buf.nbytes
    ):
        return torch.frombuffer(buf, dtype=_TORCH_OF_CODE[code])
    return torch.from_numpy(_buffer_array(buf).view(_NUMPY_OF_CODE[code]).reshape(size))


def _rebuild_array_grad(buf: Any, code: int, size: tuple[int, ...]) -> torch.Tensor:
    """:func:`_rebuild_array` for a tensor that requires grad."""
    return _rebuild_array(buf, code, size).requires_grad_(True)


def _rebuild_sparse_coo(
    indices: torch.Tensor,
    values: torch.Tensor,
    size: tuple[int, ...],
    coalesced: bool,
    requires_grad: bool,
) -> torch.Tensor:
    tensor = torch.sparse_coo_tensor(
        indices, values, size, is_coalesced=coalesced, check_invariants=False
    )
    if requires_grad:
        tensor.requires_grad_(True)
    return tensor


_NUMPY_DTYPES = (
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.float16, torch.float32, torch.float64, torch.complex64, torch.complex128,
)  # fmt: skip
#: The fast path sends a small integer for the dtype, not the pickled ``torch.dtype`` (whose
#: unpickling looks the name up in ``torch``: about 8 µs of a small message's two ends).
_CODE_OF_DTYPE: dict[torch.dtype, int] = {dtype: code for code, dtype in enumerate(_NUMPY_DTYPES)}
_TORCH_OF_CODE: tuple[torch.dtype, ...] = _NUMPY_DTYPES
_NUMPY_OF_CODE: tuple[numpy.dtype[Any], ...] = tuple(
    torch.empty(0, dtype=dtype).numpy().dtype for dtype in _NUMPY_DTYPES
)
_STRIDED = torch.strided
