"""Tensor helpers shared by unit and end-to-end tests."""

from __future__ import annotations

import torch

__all__ = ["DTYPES", "random_tensor", "same_bits"]

#: Every dtype a CPU tensor can carry over RPC (the unsigned and float8 ones where torch has them).
DTYPES: list[torch.dtype] = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex64,
    torch.complex128,
] + [
    getattr(torch, name)
    for name in ("uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2")
    if hasattr(torch, name)
]


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Random bits of ``dtype`` (NaNs and all; only valid values for bool)."""
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    itemsize = torch.empty((), dtype=dtype).element_size()
    n = 1
    for d in shape:
        n *= d
    raw = torch.randint(0, 256, (n * itemsize,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(shape)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bit pattern (NaN payloads included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    a_bytes = a.contiguous().reshape(-1).view(torch.uint8)
    b_bytes = b.contiguous().reshape(-1).view(torch.uint8)
    return bool(torch.equal(a_bytes, b_bytes))
