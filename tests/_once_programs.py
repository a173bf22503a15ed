"""Forward programs whose backward counts its node runs: the once-per-pass rule's test cases.

Each program takes a leaf ``w`` (on worker0) and returns a scalar loss. Remote steps go through
:data:`CALL` (``rpc_sync`` of distgrad's or torch's RPC, or a local call for the single-process
oracle), so one program runs on distgrad, on torch's RPC and in one process; :data:`COUNTS`
counts backward runs and hook calls in the process where they happen. Single-process autograd
runs each node once, so its counts are torch's (``tests/e2e/test_once.py`` checks that on
torch's RPC too)."""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import torch
import torch.utils.checkpoint

COUNTS: collections.Counter[str] = collections.Counter()


def _local_call(to: str, fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
    return fn(*args)


#: how a program calls another worker: ``CALL(to, fn, args)``
CALL: Callable[[str, Callable[..., Any], tuple[Any, ...]], Any] = _local_call


class Twice(torch.autograd.Function):
    """Two outputs; counts its backward runs."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x * 2, x * 3

    @staticmethod
    def backward(ctx: Any, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        COUNTS["twice"] += 1
        return a * 2 + b * 3


class Stateful(torch.autograd.Function):
    """Backward pops what forward pushed (as fairscale's Checkpoint node): a second run fails
    with ``pop from an empty deque``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.saved = collections.deque([2.0])
        return x * 2

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        COUNTS["stateful"] += 1
        return grad * ctx.saved.pop()


def scale(x: torch.Tensor) -> torch.Tensor:
    return x * 1.5


def two_rpcs(w: torch.Tensor) -> torch.Tensor:
    """A two-output Function; each output leaves in its own RPC."""
    a, b = Twice.apply(w)
    return (CALL("worker1", scale, (a,)) * CALL("worker1", scale, (b,))).sum()


def k_rpcs(w: torch.Tensor, k: int = 4) -> torch.Tensor:
    """A stateful Function's output leaves in ``k`` RPCs (to two workers)."""
    y = Stateful.apply(w)
    results = [CALL(f"worker{1 + i % 2}", scale, (y,)) for i in range(k)]
    return torch.stack(results).pow(2).sum()


def unused_result(w: torch.Tensor) -> torch.Tensor:
    """A stateful Function's output leaves in 2 RPCs; the loss uses one result (the
    reference hangs here)."""
    y = Stateful.apply(w)
    CALL("worker2", scale, (y,))
    return CALL("worker1", scale, (y,)).pow(2).sum()


def _block(x: torch.Tensor) -> torch.Tensor:
    COUNTS["block forward"] += 1
    return torch.tanh(x) * 2


def checkpointed(w: torch.Tensor, reentrant: bool) -> torch.Tensor:
    """A checkpointed block whose output leaves in 2 RPCs: recomputed once per backward.
    (The reentrant mode refuses an engine run that has ``inputs``, as torch's distributed
    engine's runs have: it fails on torch's RPC as on distgrad.)"""
    y = torch.utils.checkpoint.checkpoint(_block, w * 1, use_reentrant=reentrant)
    return (CALL("worker1", scale, (y,)) + CALL("worker2", scale, (y,))).pow(2).sum()


def _count(name: str) -> Callable[..., None]:
    def hook(*_args: Any) -> None:
        COUNTS[name] += 1

    return hook


def hooked(w: torch.Tensor) -> torch.Tensor:
    """Hooks on an intermediate whose uses leave in 2 RPCs: a tensor hook, its node's pre- and
    post-hooks, and a multi-grad hook over the two tensors sent."""
    h = w.exp()
    h.register_hook(_count("tensor hook"))
    assert h.grad_fn is not None
    h.grad_fn.register_prehook(_count("node pre-hook"))
    h.grad_fn.register_hook(_count("node post-hook"))
    a, b = h * 2, h * 3
    torch.autograd.graph.register_multi_grad_hook((a, b), _count("multi-grad hook"))
    return (CALL("worker1", scale, (a,)) * CALL("worker2", scale, (b,))).sum()


def fanout(w: torch.Tensor, k: int = 4) -> torch.Tensor:
    """One intermediate sent ``k`` times to one worker."""
    h = Stateful.apply(torch.tanh(w))
    return torch.stack([CALL("worker1", scale, (h,)) for _ in range(k)]).sum()


def stage2(x: torch.Tensor) -> torch.Tensor:
    return Stateful.apply(x).sin()


def stage1(x: torch.Tensor) -> torch.Tensor:
    """Fans out to worker2 twice and joins the results with its own output."""
    z = Stateful.apply(x * 2)
    return CALL("worker2", stage2, (z,)) + CALL("worker2", stage2, (z,)) * z


def pipeline(w: torch.Tensor) -> torch.Tensor:
    """Three stages with a fan-out and a join: worker0 -> worker1 (-> worker2 twice) and
    worker0 -> worker3 (stage 2); the loss joins both branches."""
    h = Stateful.apply(w)
    return (CALL("worker1", stage1, (h,)) * CALL("worker3", stage2, (h,))).sum()


def hop(x: torch.Tensor, hops: list[str]) -> torch.Tensor:
    """A stateful step here, then the same on the next worker of ``hops``; the result joins
    this step's output (a node that two send functions share)."""
    y = Stateful.apply(x)
    if hops:
        y = CALL(hops[0], hop, (y, hops[1:])) * y
    return y


def reentrant(w: torch.Tensor) -> torch.Tensor:
    """worker0 -> 1 -> 0 -> 1, a shared stateful node on every visit."""
    return hop(w, ["worker1", "worker0", "worker1"]).sum()


def sparse(w: torch.Tensor) -> torch.Tensor:
    """A sparse embedding's output leaves in 2 RPCs (``w`` gives the rows' weights)."""
    table = _embedding()
    rows = table(torch.tensor([1, 3, 3, 0]))
    return ((CALL("worker1", scale, (rows,)) + CALL("worker2", scale, (rows,))) * w.sum()).sum()


_TABLE: list[torch.nn.Embedding] = []


def _embedding() -> torch.nn.Embedding:
    if not _TABLE:
        torch.manual_seed(3)
        _TABLE.append(torch.nn.Embedding(5, 3, sparse=True))
    return _TABLE[0]


def checkpoint_reentrant(w: torch.Tensor) -> torch.Tensor:
    return checkpointed(w, True)


PROGRAMS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "two_rpcs": two_rpcs,
    "k_rpcs": k_rpcs,
    "unused_result": unused_result,
    "checkpoint_non_reentrant": lambda w: checkpointed(w, False),
    "hooks": hooked,
    "fanout": fanout,
    "pipeline": pipeline,
    "reentrant": reentrant,
    "sparse": sparse,
}
