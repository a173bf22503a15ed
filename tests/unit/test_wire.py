"""The wire layer alone: lazy views and the tensor table (the rest: test_pickler, test_frames)."""

from __future__ import annotations

import torch

from distgrad._wire._pickler import allocate_buffer, decode, dumps, encode, loads


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


def test_lazy_conjugate_and_negative_views_are_materialised() -> None:
    """Conjugate/negative-bit views travel as their values, not their raw storage."""
    z = torch.randn(2, 3, dtype=torch.complex64)
    for view in (z.conj(), z.conj().t(), -z.conj().imag):
        assert torch.equal(round_trip(view)[0], view)


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
