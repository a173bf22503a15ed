"""The tensor-aware pickler: pickle protocol 5 with tensor storage as out-of-band buffers.

A CPU tensor is reduced to its dtype, shape, strides, ``requires_grad`` and one
``PickleBuffer`` that points straight at the bytes of its storage -- the bytes are never
copied into the pickle stream. The buffers travel after the stream in the same frame and are
received into freshly allocated memory that becomes the new tensor's storage.

A tensor that owns exactly its storage (the common case) sends exactly ``numel * itemsize``
bytes. Any other strided tensor (a view, a slice, a lazy conjugate or negative view) follows
torch's rule: cloned when its storage is at least 8 KiB and at least twice the bytes the
tensor uses (so a small slice never drags a large storage along), otherwise sent with its
whole storage, strides, storage offset and lazy bits kept -- it arrives laid out as it was,
and views of one storage in one message arrive sharing one storage. The receiver checks
every view against the storage it received.

Sparse COO tensors travel as their (dense) indices and values. Other layouts and tensor
subclasses fall back to their own ``__reduce_ex__``, whose inner plain tensors come back
through this pickler.

A message with tensors is two pickle streams back to back, as torch's RPC pickler keeps a
side "tensor table": the *table* ``(ext, [tensors])`` carries every tensor's bytes, and the
*payload* refers to tensors by index. The receiver builds the table first, so a layer above
(distributed autograd) can attach all received tensors to one recv function before the payload
-- which may hold them anywhere, inside any object -- is built around them.

How each tensor is reduced is in ``_reducers``; the memory that received bytes land in, and the
functions that rebuild tensors around it, are in ``_buffers``.
"""

from __future__ import annotations

import copyreg
import io
import pickle
import sys
import threading
import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from ._buffers import allocate_buffer
from ._choice import (
    OWN_REDUCERS,
    ChosenPicklers,
    current_guard,
    current_pickler,
    fresh,
    restricted_loads,
    set_guard,
    set_pickler,
)
from ._choice import (
    state as choice,
)
from ._reducers import (
    DeviceCheck,
    _policy,
    _reduce_future,
    _reduce_routed_tensor,
    _reduce_storage,
    _reduce_tensor,
    _Storage,
)

__all__ = [
    "HAS_TABLE",
    "LEAN",
    "PLAIN",
    "Encoded",
    "allocate_buffer",
    "current_guard",
    "current_pickler",
    "decode",
    "deserialize_with_table",
    "dumps",
    "encode",
    "extracting_tensors",
    "is_lean",
    "is_plain",
    "lean_kind",
    "loads",
    "register_reducer",
    "restricted_loads",
    "serialize_with_table",
    "set_guard",
    "set_pickler",
]

_FUTURE_TYPES: tuple[type, ...] = (torch.futures.Future, torch._C.Future)


def _skipped() -> None:
    """What a value torch's tensor extraction skipped stands for (never unpickled)."""


#: the reduction of an object that :func:`extracting_tensors` says need not be pickled
SKIPPED: tuple[Any, ...] = (_skipped, ())


def extracting_tensors() -> bool:
    """Whether the object whose ``__reduce__`` (or ``__getstate__``) calls this is being
    pickled by torch's ``_extract_tensors``: a device-aware ``torch.futures.Future``
    completing (``rpc_async``, ``then()`` with devices configured) pickles its value with a
    plain pickler only to find the tensors in it, and skips torch's own RRefs. distgrad's
    RRef and RemoteModule refuse plain pickling, so they return :data:`SKIPPED` there instead:
    they hold no tensor that the future must synchronise (issue 29, item 2)."""
    code = _extract_tensors_code()
    frame: types.FrameType | None = sys._getframe(
        2
    )  # the pickler is C code: its caller's frame is the next one
    for _ in range(3):
        if frame is None:
            return False
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False


def _extract_tensors_code() -> Any:
    extract = getattr(torch._jit_internal, "_extract_tensors", None)
    return getattr(extract, "__code__", None)


def _table_ref(index: int) -> torch.Tensor:
    """Unpickling side of a tensor reference: the tensor from the message's table."""
    return _receiving.table[index]


def _reduce_tensor_ref(tensor: torch.Tensor) -> Any:
    """Pickling side: put the tensor in the message's table, leave its index in the stream."""
    table = _policy.table
    assert table is not None  # (set by _encode for the payload's dump)
    table.append(tensor)
    return (_table_ref, (len(table) - 1,))


# The payload stream refers to tensors by index; the table stream carries their bytes.
_PAYLOAD_DISPATCH: dict[type, Callable[[Any], Any]] = dict(copyreg.dispatch_table)
_TABLE_DISPATCH: dict[type, Callable[[Any], Any]] = dict(copyreg.dispatch_table)
_PAYLOAD_DISPATCH[torch.Tensor] = _reduce_tensor_ref
_TABLE_DISPATCH[torch.Tensor] = _reduce_tensor
_PAYLOAD_DISPATCH[_Storage] = _reduce_storage
_TABLE_DISPATCH[_Storage] = _reduce_storage
_ROUTED_DISPATCH: dict[type, Callable[[Any], Any]] = dict(copyreg.dispatch_table)
_ROUTED_DISPATCH[torch.Tensor] = _reduce_routed_tensor
_ROUTED_DISPATCH[_Storage] = _reduce_storage
for _future_type in (torch.futures.Future, torch._C.Future):
    _PAYLOAD_DISPATCH[_future_type] = _reduce_future
    _TABLE_DISPATCH[_future_type] = _reduce_future
    _ROUTED_DISPATCH[_future_type] = _reduce_future


# distgrad's own entries of each table (without copyreg's): layered over a chosen pickler's
for _name, _table in (
    ("payload", _PAYLOAD_DISPATCH),
    ("table", _TABLE_DISPATCH),
    ("routed", _ROUTED_DISPATCH),
):
    OWN_REDUCERS[_name].update(
        (k, v) for k, v in _table.items() if copyreg.dispatch_table.get(k) is not v
    )


def register_reducer(kind: type, reducer: Callable[[Any], Any]) -> None:
    """Pickle objects of exactly ``kind`` with ``reducer`` in messages (and only there: a
    layer above uses this for objects that may cross the wire but must not be pickled
    elsewhere, such as RRefs, whose pickling forks a reference)."""
    for table in (_PAYLOAD_DISPATCH, _TABLE_DISPATCH, _ROUTED_DISPATCH, *OWN_REDUCERS.values()):
        table[kind] = reducer


class _PayloadPickler(pickle.Pickler):
    dispatch_table = _PAYLOAD_DISPATCH


class _TablePickler(pickle.Pickler):
    dispatch_table = _TABLE_DISPATCH


class _RoutedPickler(pickle.Pickler):
    """A table pickler for messages whose map routes CPU tensors (always a fresh one)."""

    dispatch_table = _ROUTED_DISPATCH


def _routes_cpu(device_check: DeviceCheck | None) -> bool:
    return device_check is not None and getattr(device_check, "routes_cpu", False)


class _ThreadPicklers(threading.local):
    """Picklers per thread, reused across messages: constructing one costs more than a small
    message's whole pickling. Re-entrant use on one thread falls back to fresh ones."""

    #: the class that pickles a message whose map routes CPU tensors (always a fresh one)
    routed: type[pickle.Pickler] = _RoutedPickler

    def __init__(self) -> None:
        self.file = io.BytesIO()
        self.buffers: list[pickle.PickleBuffer] = []
        self.payload = _PayloadPickler(self.file, protocol=5, buffer_callback=self.buffers.append)
        self.table_file = io.BytesIO()
        self.table_buffers: list[pickle.PickleBuffer] = []
        self.table = _TablePickler(
            self.table_file, protocol=5, buffer_callback=self.table_buffers.append
        )
        self.busy = False

    def acquire(
        self, table: bool
    ) -> tuple[io.BytesIO, list[pickle.PickleBuffer], pickle.Pickler, bool]:
        """This thread's pickler of one kind, marked busy, or a fresh one when it is in use;
        the last item says whether it is the cached one (then :meth:`release` it)."""
        if self.busy:
            return (*fresh(_TablePickler if table else _PayloadPickler), False)
        self.busy = True
        if table:
            return self.table_file, self.table_buffers, self.table, True
        return self.file, self.buffers, self.payload, True

    def release(self) -> None:
        """Make the cached picklers ready for the next message on this thread."""
        self.file.seek(0)
        self.file.truncate()
        self.buffers.clear()
        self.payload.clear_memo()
        self.release_table()

    def release_table(self) -> None:
        """:meth:`release` after a message that used only the table pickler (one stream)."""
        file = self.table_file
        file.seek(0)
        file.truncate()
        self.table_buffers.clear()
        self.table.clear_memo()
        self.busy = False


_cached = _ThreadPicklers()


class _Receiving(threading.local):
    table: list[torch.Tensor]

    def __init__(self) -> None:
        self.table = []


_receiving = _Receiving()

#: Frame flag: the pickle stream is a tensor table followed by the payload.
HAS_TABLE = 1
#: Frame flag: the stream is plain ``pickle`` of a plain object (:func:`is_plain`: atoms and
#: functions by reference) -- no tensor, no reference, nothing a layer reduces -- so the
#: receiver may skip what only those need (the callee's lean path, ``_serving``).
PLAIN = 2
#: Frame flag: the stream is one (no table) of a request shaped as :func:`is_lean` says --
#: atoms, functions by reference and CPU tensors -- so it holds no reference (RRef) and
#: nothing for a device: the callee's lean path decodes it without collecting references.
#: (A peer that does not know it ignores it: the general path serves such a frame as well.)
LEAN = 4


@dataclass(slots=True)
class Encoded:
    """A pickled message: ``meta`` (the stream) and the out-of-band ``buffers`` to send after
    it; ``tensors`` are the message's tensors in message order (what autograd records)."""

    meta: bytes
    buffers: list[pickle.PickleBuffer]
    tensors: list[torch.Tensor]
    flags: int


_T = TypeVar("_T")
_autograd: Any = torch.autograd
_profiler_enabled: Callable[[], bool] = _autograd._profiler_enabled
_enable_record_function: Callable[[bool], None] = _autograd._enable_record_function


class _Unrecorded(threading.local):
    depth = 0


_unrecorded_state = _Unrecorded()


def _unrecorded(fn: Callable[..., _T], *args: Any) -> _T:
    """``fn(*args)`` with torch's RecordFunction off on this thread (it is thread-local).

    Used only while torch's profiler is on: pickling a tensor calls ``Tensor.numpy()``, which
    alone records ``aten::detach``, ``aten::to``, ``aten::resolve_conj`` and
    ``aten::resolve_neg``, and unpickling one records ``aten::lift_fresh`` -- distgrad's own
    work, which must not show in the user's profile as if the program had done it (torch's
    RPC pickles in C++ and shows none of it).
    """
    state = _unrecorded_state
    if state.depth:
        return fn(*args)
    state.depth = 1
    _enable_record_function(False)
    try:
        return fn(*args)
    finally:
        _enable_record_function(True)
        state.depth = 0


def encode(
    obj: Any,
    make_ext: Callable[[list[torch.Tensor]], Any] | None = None,
    device_check: DeviceCheck | None = None,
) -> Encoded:
    """Pickle ``obj`` for the wire (kept out of torch's profiler: :func:`_unrecorded`).

    With ``make_ext``, tensors are collected into a table while ``obj`` is pickled;
    ``make_ext(tensors)`` then returns the message's extension object (e.g. autograd metadata,
    which depends on the tensors), and the table stream -- ``(ext, tensors)`` with the tensor
    bytes as out-of-band buffers -- goes in front of the payload stream. Without ``make_ext``
    (no layer above wants to see the tensors: the common case) the message is one stream with
    the tensors' buffers inline, which costs one pickling pass instead of two.
    ``device_check`` routes tensors by the device maps (see :data:`DeviceCheck`).
    """
    if _profiler_enabled():
        return _unrecorded(_encode, obj, make_ext, device_check)
    picklers = choice.picklers
    if make_ext is None:  # (the common case, without a call more)
        return _encode_inline(obj, _cached if picklers is None else picklers, device_check)
    return _encode(obj, make_ext, device_check)


def _encode(
    obj: Any,
    make_ext: Callable[[list[torch.Tensor]], Any] | None,
    device_check: DeviceCheck | None,
) -> Encoded:
    cache: _ThreadPicklers | ChosenPicklers = _cached
    if choice.picklers is not None:
        cache = choice.picklers
    if make_ext is None:
        return _encode_inline(obj, cache, device_check)
    file, buffers, pickler, reuse = cache.acquire(table=False)
    tensors: list[torch.Tensor] = []
    previous = getattr(_policy, "table", None)
    _policy.table = tensors
    try:
        pickler.dump(obj)
        payload = file.getvalue()
        payload_buffers = list(buffers)
        ext = make_ext(tensors) if make_ext is not None else None
        if not tensors and ext is None:
            return Encoded(payload, payload_buffers, tensors, 0)
        table: pickle.Pickler
        if _routes_cpu(device_check):
            table_file, table_buffers, table = fresh(_RoutedPickler)
            _policy.staged = set()
        elif reuse:  # this thread's table pickler comes with its payload pickler
            assert isinstance(cache, _ThreadPicklers)
            table_file, table_buffers, table = cache.table_file, cache.table_buffers, cache.table
        else:
            table_file, table_buffers, table = fresh(_TablePickler)
        _policy.device_check = device_check
        _policy.storages = {}
        table.dump((ext, tensors))
        # the table is read first, so its buffers go first
        return Encoded(
            table_file.getvalue() + payload, table_buffers + payload_buffers, tensors, HAS_TABLE
        )
    finally:
        _policy.table = previous
        _policy.device_check = None
        _policy.staged = None
        _policy.storages = None
        if reuse:
            cache.release()


_ATOMS = frozenset({type(None), bool, int, float, complex, str, bytes})
_PLAIN_CALLABLES = frozenset({types.FunctionType, types.BuiltinFunctionType})


def is_plain(obj: Any) -> bool:
    """True for what plain pickle handles exactly as this pickler would: an atom, or a small
    tuple of atoms, module-level functions (by reference) and small tuples or str-keyed dicts
    of atoms -- the shape of a small request ``(func, args, kwargs)``. The common small
    message then skips the tensor-aware pickler's set-up (about 5 µs on each side of a call)."""
    return type(obj) in _ATOMS or lean_kind(obj) == PLAIN


_TENSOR = torch.Tensor


def is_lean(obj: Any) -> bool:
    """:func:`is_plain`'s shape with CPU tensors among its atoms (:data:`LEAN`)."""
    return lean_kind(obj) == LEAN


def lean_kind(obj: Any) -> int:
    """In one walk: ``PLAIN`` for a small tuple of :func:`is_plain`'s shape; ``LEAN`` for the
    same shape with CPU tensors (exact ``torch.Tensor``) where it allows atoms -- a request
    ``(func, args, kwargs)`` of tensors and atoms, which pickles as it would anyway (the
    tensor-aware pickler) and holds no reference and nothing for a device; 0 for anything
    else. Written as loops: generators would cost as much as they save."""
    atoms = _ATOMS
    if type(obj) is not tuple or len(obj) > 8:
        return 0
    found = PLAIN
    for item in obj:
        kind = type(item)
        if kind in atoms or kind in _PLAIN_CALLABLES:
            continue
        if kind is _TENSOR:
            if not item.is_cpu:
                return 0
            found = LEAN
        elif kind is tuple and len(item) <= 8:
            for value in item:
                if type(value) not in atoms:
                    if type(value) is not _TENSOR or not value.is_cpu:
                        return 0
                    found = LEAN
        elif kind is dict and len(item) <= 8:
            for key, value in item.items():
                if type(key) is not str:
                    return 0
                if type(value) not in atoms:
                    if type(value) is not _TENSOR or not value.is_cpu:
                        return 0
                    found = LEAN
        else:
            return 0
    return found


def _encode_inline(
    obj: Any, cache: _ThreadPicklers | ChosenPicklers, device_check: DeviceCheck | None
) -> Encoded:
    if cache is _cached and is_plain(obj):  # (a chosen pickler pickles everything)
        return Encoded(pickle.dumps(obj, protocol=5), [], [], PLAIN)
    if _routes_cpu(device_check):
        file, buffers, pickler = fresh(cache.routed)
        reuse = False
        _policy.staged = set()
    else:
        file, buffers, pickler, reuse = cache.acquire(table=True)
    _policy.device_check = device_check
    _policy.storages = {}
    try:
        pickler.dump(obj)
        return Encoded(file.getvalue(), list(buffers), [], 0)
    finally:
        _policy.device_check = None
        _policy.staged = None
        _policy.storages = None
        if reuse:
            cache.release_table()


OnTable = Callable[[Any, list[torch.Tensor]], list[torch.Tensor]]


def decode(
    meta: bytes | bytearray | memoryview,
    buffers: Iterable[Any] = (),
    flags: int = 0,
    on_table: OnTable | None = None,
) -> tuple[Any, Any]:
    """Unpickle a message; return ``(ext, obj)``.

    ``on_table(ext, tensors)`` (if given) sees the received tensors before the payload is
    built and returns the tensors the payload should contain instead (autograd substitutes
    tensors attached to its recv function here). Kept out of torch's profiler, as
    :func:`encode`.
    """
    if _profiler_enabled():
        return _unrecorded(_decode, meta, buffers, flags, on_table)
    if not flags & HAS_TABLE and choice.unpickler is None:  # (the common case)
        return None, pickle.loads(meta, buffers=buffers)
    return _decode(meta, buffers, flags, on_table)


def _decode(
    meta: bytes | bytearray | memoryview,
    buffers: Iterable[Any],
    flags: int,
    on_table: OnTable | None,
) -> tuple[Any, Any]:
    kind = choice.unpickler or pickle.Unpickler
    if not flags & HAS_TABLE:
        return None, kind(io.BytesIO(meta), buffers=buffers).load()
    # two streams, two unpicklers (each stream has its own memo), one buffer sequence
    file = io.BytesIO(meta)
    buffer_iter = iter(buffers)
    ext, tensors = choice.table_unpickler(file, buffers=buffer_iter).load()
    unpickler = kind(file, buffers=buffer_iter)
    if on_table is not None:
        tensors = on_table(ext, tensors)
    receiving = _receiving
    previous = receiving.table
    receiving.table = tensors
    try:
        obj = unpickler.load()
    finally:
        receiving.table = previous
    return ext, obj


def dumps(obj: Any) -> tuple[bytes, list[pickle.PickleBuffer], int]:
    """Pickle ``obj`` (no extension): the stream, its buffers and the frame flags."""
    encoded = encode(obj)
    return encoded.meta, encoded.buffers, encoded.flags


def loads(meta: bytes | bytearray | memoryview, buffers: Iterable[Any] = (), flags: int = 0) -> Any:
    """Unpickle a stream produced by :func:`dumps` with its received buffers."""
    return decode(meta, buffers, flags)[1]


class _TableSerializer(pickle.Pickler):
    """Messages' reducers (RRefs fork), tensors into a table by index."""

    dispatch_table = _PAYLOAD_DISPATCH

    def __init__(self, file: io.BytesIO, table: list[torch.Tensor]) -> None:
        super().__init__(file, protocol=5)
        self._table = table

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            self._table.append(obj)
            return len(self._table) - 1
        return None


class _TableDeserializer(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, table: list[torch.Tensor]) -> None:
        super().__init__(file)
        self._table = table

    def persistent_load(self, pid: Any) -> Any:
        return self._table[pid]


def serialize_with_table(obj: Any) -> tuple[bytes, list[torch.Tensor]]:
    """``obj`` as a pickle stream and the tensors it refers to by index (torch's
    ``rpc.internal.serialize``); objects with message reducers (RRefs) are reduced as in a
    message."""
    file = io.BytesIO()
    table: list[torch.Tensor] = []
    _TableSerializer(file, table).dump(obj)
    return file.getvalue(), table


def deserialize_with_table(data: bytes, tensors: list[torch.Tensor]) -> Any:
    """The object :func:`serialize_with_table` made ``(data, tensors)`` of."""
    return _TableDeserializer(io.BytesIO(data), list(tensors)).load()
