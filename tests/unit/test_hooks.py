"""Reading whether an AccumulateGrad node has hooks (``_autograd._hooks``): Python hooks of both
kinds and DistributedDataParallel's C++ reducer hooks are seen, bare nodes are not."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from distgrad._autograd._hooks import _offsets, has_node_hooks, hooks_set_aside, is_hooked


def _node(leaf: torch.Tensor) -> Any:
    return leaf.view_as(leaf).grad_fn.next_functions[0][0]  # type: ignore[union-attr]


def test_calibration_finds_the_hook_vectors() -> None:
    """On this interpreter and torch the offsets are found (else every leaf counts as hooked)."""
    assert _offsets() is not None


def test_python_hooks_on_the_node_are_seen() -> None:
    """A bare leaf's node has no hooks; a post-hook or a pre-hook makes it hooked. (A node
    lives while something holds it -- here the test, in a pass the graph.)"""
    bare, post, pre = (torch.zeros(2, requires_grad=True) for _ in range(3))
    nodes = [_node(leaf) for leaf in (bare, post, pre)]
    assert not has_node_hooks(nodes[0])
    assert not is_hooked(bare, nodes[0])
    nodes[1].register_hook(lambda grad_inputs, grad_outputs: None)
    nodes[2].register_prehook(lambda grad_outputs: None)
    assert has_node_hooks(nodes[1])
    assert has_node_hooks(nodes[2])
    assert not has_node_hooks(nodes[0])


def test_tensor_hooks_make_a_leaf_hooked_and_can_be_set_aside() -> None:
    """A leaf with a tensor hook is hooked; set aside, the hook does not run, and it is back
    (and runs) afterwards."""
    leaf = torch.ones(2, requires_grad=True)
    calls: list[int] = []
    leaf.register_hook(lambda grad: calls.append(1))
    assert is_hooked(leaf, _node(leaf))
    with hooks_set_aside([leaf], "_backward_hooks"):
        (leaf * 2).sum().backward()
    assert calls == []
    (leaf * 2).sum().backward()
    assert calls == [1]


def test_ddp_reducer_hooks_are_seen() -> None:
    """DistributedDataParallel's reducer registers C++ post-hooks on its parameters' nodes."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        layer = nn.Linear(3, 2)
        before = [has_node_hooks(_node(p)) for p in layer.parameters()]
        model = nn.parallel.DistributedDataParallel(layer)
        after = [has_node_hooks(_node(p)) for p in model.parameters()]
    finally:
        dist.destroy_process_group()
    assert before == [False, False]
    assert after == [True, True]
