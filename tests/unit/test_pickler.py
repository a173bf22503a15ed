"""Unit tests of the tensor-aware pickler (``distgrad._wire._pickler``).

Every round trip runs in both wire forms: the single inline stream (``dumps``/``loads``, what
plain RPC sends) and the tensor-table form (``encode`` with an extension hook, what the
autograd layer uses), with buffers copied into fresh receive memory as the transport does."""

from __future__ import annotations

import pickle
import re
from typing import Any

import pytest
import torch

from distgrad._errors import DistgradError, ProtocolError
from distgrad._wire._pickler import (
    HAS_TABLE,
    PLAIN,
    allocate_buffer,
    decode,
    dumps,
    encode,
    loads,
)
from tests._tensors import DTYPES, random_tensor, same_bits

FUTURE_ERROR = re.escape("Can not pickle torch.futures.Future")


@pytest.fixture(params=["inline", "table"], autouse=True)
def mode(request: pytest.FixtureRequest) -> str:
    """The wire form the round trips of a test use."""
    global MODE
    MODE = request.param
    return MODE


MODE = "inline"


def wire(obj: Any) -> tuple[Any, int]:
    """Pickle ``obj``, copy every buffer into fresh receive memory as the transport does, and
    unpickle; return the result and the number of buffer bytes that would cross the wire."""
    if MODE == "table":
        encoded = encode(obj, lambda tensors: None)
        meta, buffers, flags = encoded.meta, encoded.buffers, encoded.flags
    else:
        meta, buffers, flags = dumps(obj)
    received = []
    for buf in buffers:
        raw = buf.raw()
        copy = allocate_buffer(raw.nbytes)
        copy[:] = raw
        received.append(copy)
    return decode(meta, received, flags)[1], sum(b.raw().nbytes for b in buffers)


def roundtrip(obj: Any) -> Any:
    return wire(obj)[0]


# -- dtypes and shapes -------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_round_trips_bit_exact(dtype: torch.dtype) -> None:
    """A tensor of every dtype comes back with the same dtype, shape and bits."""
    x = random_tensor(dtype, (5, 7), seed=3)
    y = roundtrip(x)
    assert same_bits(x, y)
    assert y.data_ptr() != x.data_ptr()


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bool, torch.complex128])
def test_zero_dim_tensors(dtype: torch.dtype) -> None:
    """0-dim tensors stay 0-dim with their value."""
    x = random_tensor(dtype, (), seed=1)
    y, nbytes = wire(x)
    assert y.dim() == 0 and same_bits(x, y)
    assert nbytes == x.element_size()


@pytest.mark.parametrize("shape", [(0,), (0, 3), (4, 0, 2)])
def test_empty_tensors(shape: tuple[int, ...]) -> None:
    """Empty tensors keep their shape and dtype and send no bytes."""
    x = torch.empty(shape, dtype=torch.float64)
    y, nbytes = wire(x)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert nbytes == 0


def test_contiguous_tensor_sends_exactly_its_bytes() -> None:
    """A contiguous tensor costs numel * itemsize buffer bytes, outside the pickle stream."""
    x = torch.randn(1000, dtype=torch.float64)
    encoded = encode(x, (lambda tensors: None) if MODE == "table" else None)
    assert bool(encoded.flags & HAS_TABLE) == (MODE == "table")
    assert sum(b.raw().nbytes for b in encoded.buffers) == 8000
    assert len(encoded.meta) < 1000  # the bytes are out of band, not in the stream


# -- views -------------------------------------------------------------------------------------


def test_transposed_view_keeps_its_strides() -> None:
    """A transposed matrix arrives with the same (non-contiguous) strides and values."""
    x = torch.randn(4, 6).t()
    y, nbytes = wire(x)
    assert not y.is_contiguous()
    assert y.stride() == x.stride() == (1, 6)
    assert torch.equal(x, y)
    assert nbytes == 24 * 4


def test_small_contiguous_slice_of_a_big_tensor_sends_only_the_slice() -> None:
    """A 10-element slice of a 4 MB tensor sends 40 bytes, not the whole storage."""
    big = torch.arange(1_000_000, dtype=torch.float32)
    part = big[500_000:500_010]
    y, nbytes = wire(part)
    assert nbytes == 40
    assert torch.equal(y, part)
    assert y.storage_offset() == 0
    assert y.untyped_storage().nbytes() == 40


def test_small_strided_slice_of_a_big_tensor_sends_only_its_elements() -> None:
    """A sparse strided slice (10 elements spread over 4 MB) is made compact before sending."""
    big = torch.arange(1_000_000, dtype=torch.float32)
    part = big[3::100_000]
    y, nbytes = wire(part)
    assert nbytes == 40
    assert torch.equal(y, part)


def test_row_and_column_slices() -> None:
    """A row, a column and a 2-d strided window of a matrix come back with their values and
    layout; a storage under 8 KiB is sent whole (torch's rule), a larger one only when the
    view uses half of it."""
    for rows in (50, 60):
        base = torch.randn(rows, 40)
        for view in (base[7], base[:, 3], base[2:40:3, 5:30:4], base[10:12]):
            y, nbytes = wire(view)
            assert torch.equal(y, view) and y.shape == view.shape
            if rows * 40 * 4 < 8192:
                assert (y.stride(), y.storage_offset()) == (view.stride(), view.storage_offset())
                assert nbytes == rows * 40 * 4
            else:
                assert nbytes == view.numel() * 4 and y.is_contiguous()


def test_expanded_view_sends_the_base_elements_only() -> None:
    """An expanded view sends its few distinct elements and keeps its zero strides."""
    x = torch.randn(3, 1).expand(3, 1000)
    y, nbytes = wire(x)
    assert torch.equal(x, y)
    assert y.stride() == (1, 0)
    assert nbytes == 3 * 4


def test_scalar_expanded_to_a_big_shape() -> None:
    """A 0-stride view of one element over 1M elements costs one element on the wire."""
    x = torch.tensor(2.5, dtype=torch.float64).expand(1000, 1000)
    y, nbytes = wire(x)
    assert nbytes == 8
    assert y.shape == (1000, 1000) and bool((y == 2.5).all())


def test_lazy_conjugate_view_arrives_with_its_values() -> None:
    """A lazy conjugate view of a complex tensor arrives with the conjugated values."""
    x = torch.randn(4, dtype=torch.complex64)
    y = roundtrip(x.conj())
    assert torch.equal(y.resolve_conj(), x.conj().resolve_conj())
    assert torch.equal(y.imag, -x.imag)


def test_received_view_is_writable_and_independent() -> None:
    """The received tensor owns fresh memory: writing it leaves the original untouched."""
    x = torch.arange(6.0)
    y = roundtrip(x)
    y.add_(1)
    assert torch.equal(x, torch.arange(6.0))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_views_of_every_dtype_keep_strides_and_bits(dtype: torch.dtype) -> None:
    """Transposed and expanded views of every dtype (numpy's and the others, e.g. bfloat16)
    come back with their strides and bits, as tensors of their own (not views)."""
    base = random_tensor(dtype, (3, 5))
    for view in (base.t(), base[:, :1].expand(3, 7)):
        y = roundtrip(view)
        assert y.dtype == dtype and y.shape == view.shape and y.stride() == view.stride()
        assert same_bits(y.contiguous(), view.contiguous())
        assert not y._is_view()


@pytest.mark.parametrize("requires_grad", [False, True])
def test_contiguous_results_are_leaves_of_their_own(requires_grad: bool) -> None:
    """The fast path's received tensor is no view of a helper tensor, and keeps the flag."""
    x = torch.randn(4, 6, requires_grad=requires_grad)
    y = roundtrip(x)
    assert not y._is_view() and y.is_leaf and y.requires_grad == requires_grad
    y.detach().mul_(2)  # writable in place


def test_a_receive_buffer_sliced_from_larger_memory_is_not_read_past() -> None:
    """A buffer that is a window of a larger array is taken as the window, not the array."""
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    meta, buffers, flags = dumps(x)
    big = allocate_buffer(buffers[0].raw().nbytes + 64)
    big[16 : 16 + 48] = buffers[0].raw()
    assert torch.equal(loads(meta, [big[16 : 16 + 48]], flags), x)


@pytest.mark.parametrize("view", [False, True])
def test_a_shape_larger_than_its_buffer_is_refused(view: bool) -> None:
    """A message whose tensor shape asks for more bytes than its buffer holds (a corrupt or
    hostile peer) fails to unpickle; nothing is read past the buffer."""
    x = torch.randn(4, 4).t() if view else torch.randn(4, 4)
    meta, buffers, flags = dumps(x)
    short = allocate_buffer(buffers[0].raw().nbytes - 4)
    with pytest.raises((RuntimeError, ValueError)):
        loads(meta, [short], flags)


# -- sparse, autograd flags, parameters --------------------------------------------------------


def test_sparse_coo_coalesced() -> None:
    """A coalesced sparse COO tensor comes back coalesced with equal indices and values."""
    x = torch.sparse_coo_tensor(
        torch.tensor([[0, 1, 3], [2, 0, 4]]), torch.randn(3), (4, 5), check_invariants=True
    ).coalesce()
    y = roundtrip(x)
    assert y.is_sparse and y.is_coalesced()
    assert torch.equal(y._indices(), x._indices())
    assert torch.equal(y._values(), x._values())
    assert y.shape == x.shape


def test_sparse_coo_uncoalesced_keeps_duplicates() -> None:
    """An uncoalesced sparse tensor (duplicate indices) arrives uncoalesced, duplicates kept."""
    indices = torch.tensor([[0, 0, 2], [1, 1, 3]])
    x = torch.sparse_coo_tensor(
        indices, torch.tensor([1.0, 2.0, 3.0]), (3, 4), check_invariants=True
    )
    assert not x.is_coalesced()
    y = roundtrip(x)
    assert y.is_sparse and not y.is_coalesced()
    assert torch.equal(y._indices(), indices)
    assert torch.equal(y.to_dense(), x.to_dense())
    assert y.to_dense()[0, 1] == 3.0


def test_hybrid_sparse_with_dense_values() -> None:
    """A hybrid sparse tensor (2-d values) round-trips."""
    x = torch.sparse_coo_tensor(
        torch.tensor([[0, 3]]), torch.randn(2, 5), (4, 5), check_invariants=True
    )
    y = roundtrip(x)
    assert y.shape == (4, 5) and torch.equal(y.to_dense(), x.to_dense())


def test_requires_grad_is_preserved() -> None:
    """A leaf requiring grad arrives as a leaf requiring grad; others do not require grad."""
    leaf = torch.randn(3, requires_grad=True)
    plain = torch.randn(3)
    got_leaf, got_plain = roundtrip((leaf, plain))
    assert got_leaf.requires_grad and got_leaf.is_leaf and got_leaf.grad_fn is None
    assert torch.equal(got_leaf.detach(), leaf.detach())
    assert not got_plain.requires_grad


def test_non_leaf_requiring_grad_arrives_as_a_leaf_requiring_grad() -> None:
    """A non-leaf result of autograd arrives detached from the sender's graph but requiring grad."""
    x = torch.randn(3, requires_grad=True)
    y = roundtrip(x * 2)
    assert y.requires_grad and y.grad_fn is None
    assert torch.equal(y.detach(), (x * 2).detach())


def test_sparse_requires_grad_is_preserved() -> None:
    """A sparse tensor requiring grad keeps requires_grad."""
    x = torch.sparse_coo_tensor(
        torch.tensor([[1]]), torch.tensor([2.0]), (3,), check_invariants=True
    ).requires_grad_()
    y = roundtrip(x)
    assert y.is_sparse and y.requires_grad


@pytest.mark.parametrize("requires_grad", [True, False])
def test_nn_parameter(requires_grad: bool) -> None:
    """An nn.Parameter comes back as an nn.Parameter with its data and requires_grad."""
    p = torch.nn.Parameter(torch.randn(2, 3), requires_grad=requires_grad)
    q = roundtrip(p)
    assert isinstance(q, torch.nn.Parameter)
    assert q.requires_grad == requires_grad
    assert torch.equal(q.detach(), p.detach())


def test_module_state_dict() -> None:
    """A module's state_dict (an OrderedDict of tensors) round-trips."""
    module = torch.nn.Linear(4, 2)
    state = roundtrip(module.state_dict())
    assert list(state) == ["weight", "bias"]
    assert all(torch.equal(state[k], v) for k, v in module.state_dict().items())


# -- identity within a message -----------------------------------------------------------------


def test_a_tensor_twice_in_one_message_comes_back_as_one_object() -> None:
    """One tensor referenced three times is sent once and comes back as one object."""
    x = torch.randn(100)
    out, nbytes = wire([x, x, {"again": x}, (x,)])
    assert nbytes == 400
    assert out[0] is out[1] is out[2]["again"] is out[3][0]
    assert torch.equal(out[0], x)


def test_distinct_equal_tensors_stay_distinct() -> None:
    """Two distinct tensors with equal values come back as two objects."""
    a, b = torch.ones(3), torch.ones(3)
    x, y = roundtrip((a, b))
    assert x is not y
    x.add_(1)
    assert torch.equal(y, torch.ones(3))


def test_table_lists_each_tensor_once_in_message_order() -> None:
    """The tensor table holds each distinct tensor once, in the order the payload meets them,
    and the extension hook sees exactly that list."""
    a, b, c = torch.zeros(1), torch.ones(1), torch.full((1,), 2.0)
    seen: list[list[torch.Tensor]] = []
    encoded = encode({"first": a, "second": [b, a], "third": c}, seen.append)
    assert [t.item() for t in encoded.tensors] == [0.0, 1.0, 2.0]
    assert len(seen) == 1 and len(seen[0]) == 3
    assert all(x is y for x, y in zip(seen[0], encoded.tensors, strict=True))
    assert encoded.tensors[0] is a and encoded.tensors[1] is b and encoded.tensors[2] is c


def test_message_without_tensors_has_no_table() -> None:
    """A message without tensors is one plain pickle stream with no buffers."""
    meta, buffers, flags = dumps({"a": [1, 2.5, "x", None]})
    assert flags == 0 and buffers == []
    assert pickle.loads(meta) == {"a": [1, 2.5, "x", None]}


def test_nested_containers_and_plain_objects() -> None:
    """Tensors anywhere inside nested containers and plain objects come back in place."""
    x, y = torch.randn(2, 2), torch.arange(5)
    obj = {"a": [x, ("text", y)], "b": {1: None, 2: b"bytes"}, "c": 3.5}
    out = roundtrip(obj)
    assert torch.equal(out["a"][0], x) and torch.equal(out["a"][1][1], y)
    assert out["a"][1][0] == "text" and out["b"] == {1: None, 2: b"bytes"} and out["c"] == 3.5


def test_loads_accepts_the_buffers_as_dumped() -> None:
    """``loads`` also takes the PickleBuffers straight from ``dumps`` (no receive copy)."""
    x = torch.randn(17, 3)
    meta, buffers, flags = dumps(x)
    assert torch.equal(loads(meta, buffers, flags), x)


# -- futures -----------------------------------------------------------------------------------


def test_future_in_a_payload_cannot_be_pickled() -> None:
    """A torch Future inside a payload raises the reference's error."""
    fut: torch.futures.Future[int] = torch.futures.Future()
    with pytest.raises(RuntimeError, match=FUTURE_ERROR) as info:
        dumps({"result": [fut]})
    assert isinstance(info.value, DistgradError)


def test_future_next_to_tensors_cannot_be_pickled() -> None:
    """A completed Future next to tensors in a message raises the same error."""
    fut: torch.futures.Future[int] = torch.futures.Future()
    fut.set_result(1)
    with pytest.raises(RuntimeError, match=FUTURE_ERROR):
        dumps((torch.randn(3), fut))


def test_pickler_works_after_a_failed_dump() -> None:
    """A failed dump leaves the thread's reusable picklers clean for the next message."""
    with pytest.raises(RuntimeError, match=FUTURE_ERROR):
        dumps([torch.randn(2), torch.futures.Future()])
    x = torch.randn(4)
    meta, buffers, flags = dumps([x])
    assert len(buffers) == 1
    out = loads(meta, buffers, flags)
    assert len(out) == 1 and torch.equal(out[0], x)
    assert dumps("plain")[2] == PLAIN  # (one plain stream: no table)


def test_reentrant_dump_from_a_reducer() -> None:
    """Pickling an object whose reducer itself pickles a message (re-entrant use) works."""

    class Nested:
        def __reduce__(self) -> tuple[Any, ...]:
            inner = dumps(torch.ones(2))
            return (_nested_rebuild, (inner[0], [bytes(b.raw()) for b in inner[1]], inner[2]))

    out = roundtrip([torch.zeros(3), Nested(), torch.full((2,), 7.0)])
    assert torch.equal(out[0], torch.zeros(3))
    assert torch.equal(out[1], torch.ones(2))
    assert torch.equal(out[2], torch.full((2,), 7.0))


def _nested_rebuild(meta: bytes, buffers: list[bytes], flags: int) -> torch.Tensor:
    return loads(meta, buffers, flags)  # type: ignore[no-any-return]


# -- layout as torch's (issue 23, item 7) -------------------------------------------------------


def test_a_narrowed_view_arrives_with_its_strides_offset_and_storage() -> None:
    """``t.narrow(1, 2, 2)`` of a small tensor arrives as torch's does: the same strides and
    storage offset over a copy of the whole storage; the received view is a tensor of its
    own (no autograd view) whose in-place writes reach neither the sender's tensor nor the
    next message's."""
    t = torch.arange(24.0).reshape(4, 6)
    view = t.narrow(1, 2, 2)
    y, nbytes = wire(view)
    assert (y.stride(), y.storage_offset()) == ((6, 1), 2)
    assert y.untyped_storage().nbytes() == nbytes == 96
    assert torch.equal(y, view) and not y._is_view()
    y.add_(100)
    again = roundtrip(view)
    assert torch.equal(t, torch.arange(24.0).reshape(4, 6))
    assert torch.equal(again, view)


def test_views_of_one_storage_in_one_message_share_it_on_arrival() -> None:
    """A tensor and views of it in one message (either order) arrive on one storage, as in
    torch: a write through one received view shows in the others, and the storage is sent
    once."""
    t = torch.arange(24.0).reshape(4, 6)
    for message in ((t.narrow(1, 2, 2), t.narrow(1, 0, 2), t), (t, t[1], t.t())):
        got, nbytes = wire(message)
        assert nbytes == 96
        assert len({x.untyped_storage().data_ptr() for x in got}) == 1
        assert [x.stride() for x in got] == [x.stride() for x in message]
        assert [x.storage_offset() for x in got] == [x.storage_offset() for x in message]
        got[0].fill_(-1)
        whole = next(x for x in got if x.is_contiguous() and x.shape == (4, 6))
        assert (whole == -1).sum().item() == message[0].numel()


def test_a_big_storage_is_cloned_as_torch_clones_it() -> None:
    """A view using under half of a storage of 8 KiB or more is cloned (torch keeps a dense
    view's layout, so a transposed window stays transposed); one using more than half is sent
    with its whole storage."""
    big = torch.randn(64, 64)  # 16 KiB
    window = big[:20].t()  # 5 KiB of it, dense
    y, nbytes = wire(window)
    assert nbytes == 20 * 64 * 4 and y.stride() == window.clone().stride() == (1, 64)
    half = big[:40]
    y, nbytes = wire(half)
    assert nbytes == 64 * 64 * 4 and y.untyped_storage().nbytes() == nbytes
    assert torch.equal(y, half)


def test_lazy_conjugate_and_negative_views_keep_their_bits() -> None:
    """A lazy conjugate view (and the negative view ``x.conj().imag``) of a small storage
    arrives with its bit, strides and offset over the unconjugated storage, as torch's; one of
    a large storage is cloned, which resolves the bit (as torch's ``clone``)."""
    x = torch.randn(3, 4, dtype=torch.complex64)
    for view in (x.conj(), x.conj()[:, 1:3], x.conj().imag):
        y = roundtrip(view)
        assert (y.is_conj(), y.is_neg()) == (view.is_conj(), view.is_neg())
        assert (y.stride(), y.storage_offset()) == (view.stride(), view.storage_offset())
        assert torch.equal(y.resolve_conj().resolve_neg(), view.resolve_conj().resolve_neg())
    big = torch.randn(64, 64, dtype=torch.complex64).conj()[:2]
    y = roundtrip(big)
    assert not y.is_conj() and torch.equal(y, big.resolve_conj())


def _view_frame(
    size: Any, stride: Any, offset: Any, nbytes: int = 96, *extra: Any
) -> tuple[bytes, list[Any]]:
    """A hand-made message: one float32 view over a storage of ``nbytes`` received bytes."""
    from distgrad._wire._buffers import _rebuild_view
    from distgrad._wire._reducers import _Storage

    class Frame:
        def __reduce__(self) -> Any:
            holder = _Storage(memoryview(bytearray(nbytes)))
            return (_rebuild_view, (holder, torch.float32, size, stride, offset, False, *extra))

    meta, buffers, _flags = dumps(Frame())
    received = []
    for buf in buffers:
        copy = allocate_buffer(buf.raw().nbytes)
        copy[:] = buf.raw()
        received.append(copy)
    return meta, received


@pytest.mark.parametrize(
    ("size", "stride", "offset"),
    [
        ((4, 6), (6, 1), 1),  # one element past the end
        ((2, 2), (6, 1), 23),
        ((3,), (100,), 0),
        ((2,), (-1,), 5),  # negative stride
        ((2,), (1,), -1),
        ((2, 2), (1,), 0),  # ranks differ
        ((True,), (1,), 0),
        ((2.0,), (1,), 0),
        ([2], [1], 0),
        ((1,) * 2000, (1,) * 2000, 0),
    ],
    ids=[
        "past_the_end",
        "offset_past_the_end",
        "stride_past_the_end",
        "negative_stride",
        "negative_offset",
        "ranks_differ",
        "bool_size",
        "float_size",
        "list_size",
        "too_many_dims",
    ],
)
def test_a_view_reaching_past_its_received_storage_is_refused(
    size: Any, stride: Any, offset: Any
) -> None:
    """Sizes, strides and offsets from the wire are checked against the storage received
    with them: a view that would reach past it, or malformed ones, raise ProtocolError and
    make no tensor."""
    meta, received = _view_frame(size, stride, offset)
    with pytest.raises(ProtocolError, match="received tensor view"):
        loads(meta, received)


@pytest.mark.parametrize("bits", [4, -1, 1.0, 1], ids=["unknown", "negative", "float", "conj_real"])
def test_invalid_lazy_bits_are_refused(bits: Any) -> None:
    """Lazy bits from the wire are checked: unknown ones, and a conjugate bit on a real
    dtype, raise ProtocolError."""
    meta, received = _view_frame((2,), (1,), 0, 96, bits)
    with pytest.raises(ProtocolError, match="received tensor"):
        loads(meta, received)


def test_a_view_inside_its_received_storage_is_accepted() -> None:
    """The last element of the storage is reachable; an empty view may sit at its end."""
    meta, received = _view_frame((2, 2), (6, 1), 16)
    assert loads(meta, received).shape == (2, 2)
    meta, received = _view_frame((0, 3), (3, 1), 24)
    assert loads(meta, received).shape == (0, 3)


# -- odd strides -------------------------------------------------------------------------------


def test_offset_transposed_window_keeps_its_strides() -> None:
    """A transposed window with a storage offset and gaps is sent as its span, strides kept."""
    base = torch.randn(64, 48)
    view = base[1:, 2:].t()
    assert view.storage_offset() == 50
    y, nbytes = wire(view)
    assert torch.equal(y, view)
    assert y.stride() == view.stride() == (1, 48)
    assert view.numel() * 4 < nbytes <= 2 * view.numel() * 4


def test_zero_dim_view_into_a_big_tensor() -> None:
    """One element of a big tensor (a 0-dim view) sends one element."""
    big = torch.arange(1_000_000, dtype=torch.float32)
    y, nbytes = wire(big[500_000])
    assert y.dim() == 0 and y.item() == 500_000.0
    assert nbytes == 4


def test_overlapping_strides() -> None:
    """A view whose elements overlap in memory (as_strided) comes back with its values."""
    x = torch.arange(10.0).as_strided((5, 3), (1, 1))
    y = roundtrip(x)
    assert torch.equal(y, x)


def test_size_one_dimensions_with_odd_strides() -> None:
    """Size-1 dimensions with arbitrary strides (still contiguous) round-trip."""
    x = torch.empty_strided((3, 1, 2), (2, 1000, 1)).copy_(torch.randn(3, 1, 2))
    assert x.is_contiguous()
    y, nbytes = wire(x)
    assert torch.equal(y, x)
    assert nbytes == 24


def test_empty_tensor_with_odd_strides() -> None:
    """An empty view of a big tensor sends nothing and keeps its shape."""
    big = torch.randn(100, 100)
    view = big[:, 5:5]
    y, nbytes = wire(view)
    assert y.shape == (100, 0) and nbytes == 0


def _plain_target(x: int) -> int:
    return x


@pytest.mark.parametrize(
    "obj",
    [
        None,
        3,
        2.5,
        "text",
        b"bytes",
        (_plain_target, (1, "a", None), {"k": 2.0}),
        (_plain_target, (), {}),
        (torch.add, (1, 2), {}),
    ],
    ids=repr,
)
def test_plain_messages_take_the_fast_path_and_round_trip(obj: Any) -> None:
    """Atoms and small requests of atoms go through plain pickle (no tensor table set-up) and
    come back equal; the stream is the one plain pickle makes, flagged ``PLAIN`` (the callee
    skips what only tensors and references need)."""
    from distgrad._wire._pickler import is_plain

    assert is_plain(obj)
    encoded = encode(obj)
    assert encoded.meta == pickle.dumps(obj, protocol=5)
    assert encoded.buffers == [] and encoded.flags == PLAIN
    assert loads(encoded.meta) == obj


@pytest.mark.parametrize(
    "obj",
    [
        torch.ones(2),
        (_plain_target, (torch.ones(2),), {}),
        (_plain_target, (), {"t": torch.ones(2)}),
        (_plain_target, ([1, 2],), {}),  # a list: one level deeper than the fast path looks
        (_plain_target, tuple(range(9)), {}),  # too long to scan
        [1, 2, 3],
        {"a": 1},
    ],
    ids=lambda o: type(o).__name__,
)
def test_anything_else_takes_the_tensor_aware_pickler(obj: Any) -> None:
    """Tensors anywhere (and shapes the fast path does not scan) go through the tensor-aware
    pickler: their storage travels out of band."""
    from distgrad._wire._pickler import is_plain

    assert not is_plain(obj)
    encoded = encode(obj)
    back = loads(encoded.meta, [b.raw() for b in encoded.buffers], encoded.flags)
    if isinstance(obj, torch.Tensor):
        assert encoded.buffers and torch.equal(back, obj)
    elif isinstance(obj, tuple) and any(isinstance(a, torch.Tensor) for a in obj[1]):
        assert encoded.buffers and torch.equal(back[1][0], obj[1][0])
