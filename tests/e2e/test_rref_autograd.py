"""Distributed autograd through RRefs: ``remote()`` and ``to_here()`` take part in contexts as
in the reference, and ``rref.backward(ctx)`` runs the pass on the owner; gradients are checked
against single-process autograd."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import distgrad.autograd as dist_autograd
import distgrad.rpc as rpc
from tests._harness import run_workers

pytestmark = pytest.mark.timeout(120)

_PARAMS: dict[str, torch.Tensor] = {}


def layer(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ w)


def owned_weight() -> torch.Tensor:
    """A parameter that lives on this worker (created outside any context)."""
    torch.manual_seed(1)
    _PARAMS["w"] = torch.randn(3, 2, requires_grad=True)
    return _PARAMS["w"]


def weight_grad(context_id: int) -> torch.Tensor | None:
    grads = dist_autograd.get_gradients(context_id)
    return grads.get(_PARAMS["w"])


def scalar_loss(x: torch.Tensor) -> torch.Tensor:
    return (x * x).sum() * 0.5


def inputs() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return torch.randn(4, 3, requires_grad=True), torch.randn(3, 2, requires_grad=True)


def local_reference() -> dict[str, torch.Tensor]:
    x, w = inputs()
    w2 = owned_weight().detach().clone().requires_grad_(True)
    y = layer(x, w)  # remote(layer) + to_here
    z = layer(x, w2)  # RRef(w2) created outside the context, fetched inside
    loss = (y.sum() + z.pow(2).sum()) * 2
    loss.backward()
    x2 = inputs()[0]
    scalar_loss(x2 * 3).backward()  # rref.backward on a user
    assert x.grad is not None and w.grad is not None and w2.grad is not None
    assert x2.grad is not None
    return {"x": x.grad, "w": w.grad, "w2": w2.grad, "x2": x2.grad}


def through_rrefs(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if rank != 0:
        return out
    x, w = inputs()
    weight = rpc.remote("worker2", owned_weight)  # outside any context
    with dist_autograd.context() as ctx:
        y_rref = rpc.remote("worker1", layer, args=(x, w))
        y = y_rref.to_here()
        z = layer(x, weight.to_here())
        loss = (y.sum() + z.pow(2).sum()) * 2
        dist_autograd.backward(ctx, [loss])
        grads = dist_autograd.get_gradients(ctx)
        out["x"], out["w"] = grads[x], grads[w]
        out["w2"] = rpc.rpc_sync("worker2", weight_grad, (ctx,))
        out["leaf_grad_untouched"] = x.grad is None and w.grad is None
        out["known"] = sorted(dist_autograd._current_context()._known_worker_ids())
    x2 = inputs()[0]
    with dist_autograd.context() as ctx:
        loss_rref = rpc.remote("worker1", scalar_loss, args=(x2 * 3,))
        loss_rref.backward(ctx)  # a user RRef: the pass runs on its owner, worker1
        out["x2"] = dist_autograd.get_gradients(ctx)[x2]
    # on the owner, without a context: a local backward
    local = rpc.RRef(scalar_loss(torch.ones(2, requires_grad=True)))
    local.backward()
    return out


def test_gradients_flow_through_remote_and_to_here() -> None:
    """remote() of a Python function and to_here() inside a context record send/recv
    functions (also for an RRef created before the context); gradients on the caller and on
    the owner of a fetched parameter equal local autograd's; user_rref.backward(ctx) runs the
    pass on the owner."""
    out = run_workers(through_rrefs, 3, timeout=90)[0]
    expected = local_reference()
    for key in ("x", "w", "w2", "x2"):
        torch.testing.assert_close(out[key], expected[key], msg=key)
    assert out["leaf_grad_untouched"]
    assert out["known"] == [1, 2]
