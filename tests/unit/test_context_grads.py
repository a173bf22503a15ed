"""What the distributed backward stores in a context, on in-memory worlds: a gradient the
user's code can still reach is copied (never aliased), one that nothing else reaches is taken
over without a copy (issue 23, item 5)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import distgrad.autograd as dist_autograd
import distgrad.rpc as rpc
from distgrad._autograd import _context_state
from distgrad.testing import open_world

_kept: list[torch.Tensor] = []


class SameForBoth(torch.autograd.Function):
    """``a + b`` whose backward returns one tensor as the gradient of both inputs (and keeps
    it, as user code may)."""

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a + b

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = grad * 2
        _kept.append(out)
        return out, out


def times(x: torch.Tensor, k: float) -> torch.Tensor:
    return x * k


def test_one_tensor_for_two_inputs_is_copied_for_both() -> None:
    """A custom Function's backward returning one tensor for two inputs: the context holds two
    gradients that share memory neither with each other nor with the returned tensor (as
    torch's context), and equal single-process autograd's."""
    _kept.clear()

    def body(rank: int) -> tuple[list[int], list[float], list[float]]:
        with dist_autograd.context() as context_id:
            a = torch.ones(3, requires_grad=True)
            b = torch.ones(3, requires_grad=True)
            y = rpc.rpc_sync("worker1", times, (SameForBoth.apply(a, b), 3.0))
            dist_autograd.backward(context_id, [y.sum()])
            grads = dist_autograd.get_gradients(context_id)
            pointers = [grads[a].data_ptr(), grads[b].data_ptr(), _kept[0].data_ptr()]
            grads[a].add_(1)  # must not reach b's gradient
            return pointers, grads[a].tolist(), grads[b].tolist()

    with open_world(2) as world:
        pointers, ga, gb = world.run(body, ranks=[0])[0]
    assert len(set(pointers)) == 3, pointers
    local_a = torch.ones(3, requires_grad=True)
    local_b = torch.ones(3, requires_grad=True)
    (SameForBoth.apply(local_a, local_b) * 3.0).sum().backward()
    assert gb == local_b.grad.tolist()  # type: ignore[union-attr]
    assert ga == (local_a.grad + 1).tolist()  # type: ignore[operator]


_table: dict[str, torch.nn.Embedding] = {}


def lookup(indices: torch.Tensor) -> torch.Tensor:
    return _table["emb"](indices)


def owner_grad(context_id: int) -> torch.Tensor:
    return dist_autograd.get_gradients(context_id)[_table["emb"].weight].coalesce()


def test_a_sparse_embedding_gradient_keeps_its_values_without_a_copy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An embedding's sparse gradient over RPC is stored with the engine's values tensor (no
    copy: nothing else refers to it once the engine is done with the incoming gradient),
    its indices copied (they are the lookup's index tensor), and equals local autograd's."""
    torch.manual_seed(0)
    emb = torch.nn.Embedding(50, 4, sparse=True)
    _table["emb"] = emb
    rows = 6
    copies: list[tuple[Any, tuple[int, ...]]] = []
    clone = torch.Tensor.clone

    def counting_clone(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        copies.append((self.layout, tuple(self.shape)))
        return clone(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "clone", counting_clone)
    indices = torch.tensor([1, 7, 7, 3, 9, 1])
    weights = torch.arange(rows * 4, dtype=torch.float32).reshape(rows, 4)

    def trainer(rank: int) -> torch.Tensor:
        with dist_autograd.context() as context_id:
            out = rpc.rpc_sync("worker1", lookup, (indices,))
            dist_autograd.backward(context_id, [(out * weights).sum()])
            return rpc.rpc_sync("worker1", owner_grad, (context_id,))  # type: ignore[no-any-return]

    with open_world(2) as world:
        grad = world.run(trainer, ranks=[0])[0]
    del _table["emb"]
    values_copied = [(layout, shape) for layout, shape in copies if shape in ((rows, 4), (50, 4))]
    # (a torch without Tensor._use_count, 2.3, copies every first gradient)
    assert (values_copied == []) is _context_state._counts, copies
    expected = torch.nn.Embedding(50, 4, sparse=True)
    expected.load_state_dict(emb.state_dict())
    (expected(indices) * weights).sum().backward()
    assert torch.equal(grad.to_dense(), expected.weight.grad.to_dense())  # type: ignore[union-attr]
