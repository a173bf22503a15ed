"""The wire layer alone: the tensor pickler and the frame parser, no sockets."""

from __future__ import annotations

import random

import pytest
import torch

from distgrad._errors import MessageTooLargeError, ProtocolError
from distgrad._wire._frames import HEADER, MAX_BUFFERS, FrameParser, Kind, encode_frame
from distgrad._wire._pickler import allocate_buffer, decode, dumps, encode, loads

DTYPES = [
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.uint16, torch.uint32, torch.uint64, torch.float16, torch.bfloat16, torch.float32,
    torch.float64, torch.complex64, torch.complex128,
]  # fmt: skip


def _received(buffers: list) -> list[memoryview]:  # type: ignore[type-arg]
    """What a receiver would hold: fresh memory with the bytes copied in."""
    out = []
    for buffer in buffers:
        raw = buffer.raw()
        copy = allocate_buffer(raw.nbytes)
        copy[:] = raw
        out.append(copy)
    return out


def round_trip(obj: object) -> tuple[object, int]:
    meta, buffers, flags = dumps(obj)
    sent = sum(b.raw().nbytes for b in buffers)
    return loads(meta, _received(buffers), flags), sent


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_round_trips_bit_exact(dtype: torch.dtype) -> None:
    """Every dtype comes back equal, with its dtype and shape."""
    x = (torch.randn(4, 5) * 50).to(dtype) if dtype != torch.bool else torch.rand(4, 5) > 0.5
    y, sent = round_trip(x)
    assert isinstance(y, torch.Tensor) and y.dtype == dtype and torch.equal(y, x)
    assert sent == x.numel() * x.element_size()


def test_views_send_only_what_they_span() -> None:
    """Transposes keep their strides; a small slice of a big tensor sends a few bytes only;
    expanded views send their (small) storage; 0-d and empty tensors work."""
    base = torch.randn(1000, 1000)
    t, sent = round_trip(base.t())
    assert torch.equal(t, base.t()) and t.stride() == base.t().stride()
    assert sent == base.numel() * 4
    piece, sent = round_trip(base[10:12, 5:9])
    assert torch.equal(piece, base[10:12, 5:9]) and sent <= 2 * 1000 * 4
    strided, sent = round_trip(base[::100, ::100])
    assert torch.equal(strided, base[::100, ::100]) and sent == 100 * 4
    row = torch.randn(1, 8)
    expanded, sent = round_trip(row.expand(500, 8))
    assert torch.equal(expanded, row.expand(500, 8)) and sent == 8 * 4
    assert torch.equal(round_trip(torch.tensor(2.5))[0], torch.tensor(2.5))
    assert round_trip(torch.empty(0, 3))[0].shape == (0, 3)


def test_lazy_conjugate_and_negative_views_are_materialised() -> None:
    """Conjugate/negative-bit views travel as their values, not their raw storage."""
    z = torch.randn(2, 3, dtype=torch.complex64)
    for view in (z.conj(), z.conj().t(), -z.conj().imag):
        assert torch.equal(round_trip(view)[0], view)


def test_sparse_parameters_and_flags() -> None:
    """Sparse COO (coalesced or not), nn.Parameter and requires_grad survive; the same tensor
    twice in a message comes back as one object."""
    indices = torch.tensor([[0, 2, 2], [1, 0, 0]])
    sparse = torch.sparse_coo_tensor(indices, torch.randn(3), (3, 4), check_invariants=False)
    for s in (sparse, sparse.coalesce()):
        back, _ = round_trip(s)
        assert back.is_sparse and back.is_coalesced() == s.is_coalesced()
        assert torch.equal(back.to_dense(), s.to_dense())
    param = torch.nn.Parameter(torch.randn(3))
    back, _ = round_trip(param)
    assert isinstance(back, torch.nn.Parameter) and torch.equal(back, param)
    leaf = torch.randn(2, requires_grad=True)
    back, _ = round_trip(leaf)
    assert back.requires_grad and back.is_leaf
    x = torch.randn(3)
    pair, _ = round_trip((x, x))
    assert pair[0] is pair[1]


def test_futures_cannot_be_pickled() -> None:
    """A torch Future in a payload raises the reference's error."""
    with pytest.raises(RuntimeError, match=r"Can not pickle torch\.futures\.Future"):
        dumps(torch.futures.Future())


def test_tensor_table_lets_the_receiver_substitute_tensors() -> None:
    """With an extension, the receiver sees every tensor (wherever it sits) before the payload
    is built, in message order, and may substitute them."""
    a, b = torch.randn(2), torch.randn(3)
    payload = {"x": [a, ("text", b)], "y": a}
    encoded = encode(payload, lambda tensors: ("ext", len(tensors)))
    assert encoded.tensors == [a, b]
    seen: list[object] = []

    def on_table(ext: object, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        seen.append(ext)
        return [t * 10 for t in tensors]

    ext, obj = decode(encoded.meta, _received(encoded.buffers), encoded.flags, on_table)
    assert ext == ("ext", 2) and seen == [("ext", 2)]
    assert torch.equal(obj["x"][0], a * 10) and torch.equal(obj["x"][1][1], b * 10)
    assert obj["y"] is obj["x"][0]


def _stream(count: int) -> tuple[list[tuple[int, object]], bytes]:
    rng = random.Random(7)
    messages = []
    chunks = []
    for i in range(count):
        size = rng.choice([0, 1, 100, 70_000, 300_000])
        obj = (i, torch.randn(size // 4), "s" * rng.choice([0, 10, 70_000]))
        meta, buffers, flags = dumps(obj)
        messages.append((i, obj))
        chunks.append(
            b"".join(bytes(p) for p in encode_frame(Kind.REQUEST, i, meta, buffers, flags))
        )
    return messages, b"".join(chunks)


def test_parser_reassembles_frames_from_any_chunking() -> None:
    """A stream of small and large frames parses identically whatever the read sizes."""
    messages, stream = _stream(60)
    rng = random.Random(1)
    for _ in range(3):
        parser = FrameParser(1 << 30)
        frames = []
        pos = 0
        while pos < len(stream):
            buf = parser.get_buffer()
            n = min(len(buf), rng.choice([1, 7, 4096, 65536, 1 << 20]), len(stream) - pos)
            buf[:n] = stream[pos : pos + n]
            pos += n
            frames.extend(parser.buffer_updated(n))
        assert [f.message_id for f in frames] == [i for i, _ in messages]
        for frame, (_, obj) in zip(frames, messages, strict=True):
            got = loads(frame.meta, frame.buffers, frame.flags)
            assert got[0] == obj[0] and torch.equal(got[1], obj[1]) and got[2] == obj[2]


def _feed(parser: FrameParser, data: bytes) -> None:
    buf = parser.get_buffer()
    buf[: len(data)] = data
    parser.buffer_updated(len(data))


def test_parser_rejects_bad_frames_before_allocating() -> None:
    """Unknown kinds, too many buffers and sizes above the limit raise at the header, before
    anything is allocated for the body."""
    with pytest.raises(ProtocolError, match="unknown frame kind"):
        _feed(FrameParser(1024), HEADER.pack(99, 0, 0, 0, 1))
    with pytest.raises(ProtocolError, match="buffers"):
        _feed(FrameParser(1024), HEADER.pack(Kind.REQUEST, 0, MAX_BUFFERS + 1, 0, 1))
    with pytest.raises(MessageTooLargeError, match="maximum message size is 1024"):
        _feed(FrameParser(1024), HEADER.pack(Kind.REQUEST, 0, 0, 2048, 1))
    huge = HEADER.pack(Kind.REQUEST, 0, 1, 10, 1) + (1 << 40).to_bytes(8, "little")
    with pytest.raises(MessageTooLargeError):
        _feed(FrameParser(1024), huge)
