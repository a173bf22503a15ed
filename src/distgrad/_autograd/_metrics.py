"""Distributed autograd's figures for the agent's metrics (``AutogradLayer.metrics``): backward
passes driven by each worker -- started, failed, their seconds -- and the gradient bytes it sent
to peers. Kept by worker id, so that several agents in one process (tests) keep theirs apart."""

from __future__ import annotations

import threading

import torch

__all__ = ["figures", "gradients_sent", "pass_ended", "tensor_bytes"]

_lock = threading.Lock()
#: worker id -> [passes, failed, seconds, gradient bytes sent]
_by_worker: dict[int, list[float]] = {}


def _entry(worker: int) -> list[float]:
    entry = _by_worker.get(worker)
    if entry is None:
        entry = _by_worker.setdefault(worker, [0, 0, 0.0, 0])
    return entry


def pass_ended(worker: int, seconds: float, *, failed: bool) -> None:
    """A backward pass that ``worker`` drove ended after ``seconds``."""
    with _lock:
        entry = _by_worker.get(worker) or _entry(worker)
        entry[0] += 1
        entry[2] += seconds
        if failed:
            entry[1] += 1


def tensor_bytes(grad: torch.Tensor) -> int:
    """The bytes a gradient of a layout other than strided carries (a sparse one: its values
    and indices)."""
    try:
        if grad.is_sparse:
            return int(grad._values().nbytes + grad._indices().nbytes)
        return int(grad.nbytes)
    except (RuntimeError, NotImplementedError):  # (an exotic layout: its elements' bytes)
        return grad.numel() * grad.element_size()


def gradients_sent(worker: int, nbytes: int) -> None:
    """``worker`` sent ``nbytes`` of gradients to peers (one part of a pass, when it ends)."""
    with _lock:
        (_by_worker.get(worker) or _entry(worker))[3] += nbytes


def figures(worker: int) -> dict[str, float]:
    """The worker's figures, named as the metrics that expose them."""
    with _lock:
        passes, failed, seconds, nbytes = _by_worker.get(worker, (0, 0, 0.0, 0))
    return {
        "backward_passes_total": passes,
        "backward_passes_failed_total": failed,
        "backward_seconds_total": seconds,
        "gradient_bytes_sent_total": nbytes,
    }
