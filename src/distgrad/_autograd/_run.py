"""One run of torch's engine in a pass, and the leaves it fills: their gradients go to the
context, a hooked leaf's (``_hooks``) is summed and its hooks run once it is complete."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.autograd.graph import GradientEdge

from ._context import CONTAINER, DistAutogradContext
from ._functions import run_engine
from ._hooks import (
    GRAD_LOCK,
    HookedLeaf,
    borrowed_grads,
    hooks_set_aside,
    is_hooked,
    run_accumulators,
)

__all__ = ["execute", "flush_hooked"]

_ACCUMULATE_GRAD: Any = torch._C._functions.AccumulateGrad  # type: ignore[attr-defined]


def execute(
    ctx: DistAutogradContext,
    roots: list[Any],
    grads: list[torch.Tensor],
    leaves: dict[int, torch.Tensor],
    accumulators: dict[int, Any],
    recv_edges: list[list[GradientEdge]],
    captures: list[tuple[Any, int]],
    retain: bool,
    hooked: dict[int, HookedLeaf],
) -> tuple[list[list[torch.Tensor | None]], list[torch.Tensor | None]] | None:
    """Run torch's engine from ``roots``; store the leaves' gradients in ``ctx`` (a hooked
    leaf's in ``hooked``, for :func:`flush_hooked`). Returns the gradients at each recv
    function's edges and at the ``captures`` edges, or None if the run has no input."""
    leaf_list = list(leaves.values())
    inputs: list[Any] = list(leaf_list)
    for edges in recv_edges:
        inputs.extend(edges)
    if not inputs:
        return None
    inputs.extend(GradientEdge(node, nr) for node, nr in captures)
    hooked_now = [leaf for leaf in leaf_list if is_hooked(leaf, accumulators[id(leaf)])]
    # a leaf captured for later (``_plan``): its hooks run once, on its whole gradient
    waiting: list[torch.Tensor] = [
        node.variable for node, _ in captures if type(node) is _ACCUMULATE_GRAD
    ]
    quiet = hooked_now + [leaf for leaf in waiting if leaf._backward_hooks]
    if quiet:
        with GRAD_LOCK, hooks_set_aside(quiet, "_backward_hooks"):
            captured = list(run_engine(roots, grads, inputs, retain))
    else:
        captured = list(run_engine(roots, grads, inputs, retain))
    # The run takes the incoming gradients over: once torch's engine is done with them,
    # nothing here refers to them any more, so what the engine built on them -- a sparse
    # gradient's values are a view of the embedding output's gradient -- may be stored
    # without a copy when no user code kept them.
    grads.clear()
    position = len(leaf_list)
    recv_grads: list[list[torch.Tensor | None]] = []
    for edges in recv_edges:
        recv_grads.append(captured[position : position + len(edges)])
        position += len(edges)
    at_captures = captured[position:]
    hooked_ids = {id(leaf) for leaf in hooked_now}
    pairs = []
    for index, leaf in enumerate(leaf_list):
        grad = captured[index]
        if grad is None:
            continue
        captured[index] = None  # (the pair holds the engine's gradient alone: see below)
        if id(leaf) in hooked_ids:
            pending = hooked.get(id(leaf))
            if pending is None:
                pending = hooked[id(leaf)] = HookedLeaf(leaf, accumulators[id(leaf)])
            pending.add(grad)
        else:
            pairs.append((leaf, grad))
    grad = None
    if pairs:
        # a gradient that only its pair refers to is taken over without a copy
        ctx.accumulate_grads(pairs)
    del pairs
    return recv_grads, at_captures


def flush_hooked(
    ctx: DistAutogradContext, hooked: dict[int, HookedLeaf], complete: Callable[[int], bool]
) -> None:
    """Run the hooks of the hooked leaves whose gradient is ``complete`` (by the variable's
    id: no unresolved source can reach it any more), once, on their whole gradient of the
    pass (``_hooks``)."""
    ready = [p for key, p in hooked.items() if p.grad is not None and complete(key)]
    if not ready:
        return
    # every hooked leaf of the pass is lent: a reducer's last hook may write any of them
    lent = [pending.variable for pending in hooked.values()]
    with GRAD_LOCK, CONTAINER.forced_current(ctx.context_id):
        with borrowed_grads(lent, ctx.grads_of(lent)):
            run_accumulators(ready)
            results = [(variable, variable.grad) for variable in lent]
        ctx.replace_grads(results)
