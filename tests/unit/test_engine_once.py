"""Each node of a worker's graph runs once per distributed backward pass, with the sum of its
gradients (torch's rule), on in-memory worlds: call and hook counts equal single-process
autograd's (torch's, which tests/e2e/test_once.py checks on torch's RPC), and so do the
gradients; unused RPC results still finish; a failed pass is quiet afterwards."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import torch

import distgrad.autograd as dist_autograd
import distgrad.rpc as rpc
from distgrad._autograd import _pass, _plan
from distgrad._autograd._functions import edge_roots
from distgrad.testing import open_world
from tests import _once_programs as programs

WORLD = 4
#: torch before 2.4 cannot start its engine from GradientEdge roots: distgrad keeps the
#: per-message runs there (docs/migration.md), so these cases fail as documented
ONCE_PER_PASS = pytest.mark.xfail(
    not edge_roots(),
    reason="torch < 2.4: the engine runs once per gradient message (documented); the cases "
    "with no shared node pass there too",
    strict=False,
)


@pytest.fixture
def distributed_calls() -> Iterator[None]:
    programs.CALL = rpc.rpc_sync
    try:
        yield
    finally:
        programs.CALL = programs._local_call


def _leaf() -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randn(3).requires_grad_()


def _local(name: str, passes: int = 1) -> tuple[torch.Tensor, dict[str, int]]:
    """The gradient and the counts of ``passes`` backward passes in one process."""
    programs.COUNTS.clear()
    w = _leaf()
    loss = programs.PROGRAMS[name](w)
    for _ in range(passes):
        loss.backward(retain_graph=passes > 1)  # (not .grad(): reentrant checkpoints refuse it)
    assert w.grad is not None
    return w.grad / passes, dict(programs.COUNTS)


def _distributed(world: object, name: str, passes: int = 1) -> tuple[torch.Tensor, dict[str, int]]:
    programs.COUNTS.clear()

    def body(rank: int) -> torch.Tensor | None:
        if rank != 0:
            return None
        w = _leaf()
        with dist_autograd.context() as context_id:
            loss = programs.PROGRAMS[name](w)
            for _ in range(passes):
                dist_autograd.backward(context_id, [loss], retain_graph=passes > 1)
            return dist_autograd.get_gradients(context_id)[w] / passes

    grad = world.run(body)[0]  # type: ignore[attr-defined]
    return grad, dict(programs.COUNTS)


@ONCE_PER_PASS
@pytest.mark.parametrize("name", sorted(programs.PROGRAMS))
def test_each_node_runs_once_as_in_local_autograd(name: str, distributed_calls: None) -> None:
    """Counting and stateful Functions whose outputs leave in 2 and k RPCs, both checkpoint
    modes, hooks, fan-out, a 3-stage pipeline, a re-entrant chain, sparse gradients: the
    counts and the gradient are single-process autograd's."""
    programs.CALL = programs._local_call
    expected_grad, expected_counts = _local(name)
    programs.CALL = rpc.rpc_sync
    with open_world(WORLD, timeout=20) as world:
        grad, counts = _distributed(world, name)
    assert counts == expected_counts
    torch.testing.assert_close(grad, expected_grad)


@ONCE_PER_PASS
@pytest.mark.parametrize("name", ["two_rpcs", "hooks"])
def test_retained_graph_runs_each_node_once_per_pass(name: str, distributed_calls: None) -> None:
    """Three passes over one retained graph: three runs of each node, gradients summed."""
    programs.CALL = programs._local_call
    expected_grad, expected_counts = _local(name, passes=3)
    programs.CALL = rpc.rpc_sync
    with open_world(WORLD, timeout=20) as world:
        grad, counts = _distributed(world, name, passes=3)
    assert counts == expected_counts
    torch.testing.assert_close(grad, expected_grad)


@ONCE_PER_PASS
def test_a_reentrant_checkpoint_fails_as_on_torch(distributed_calls: None) -> None:
    """torch's reentrant checkpoint refuses engine runs with ``inputs`` (torch's distributed
    engine's runs have them too): the pass fails with torch's message, and nothing hangs."""

    def body(rank: int) -> str | None:
        if rank != 0:
            return None
        w = _leaf()
        with dist_autograd.context() as context_id:
            loss = programs.checkpoint_reentrant(w)
            with pytest.raises(RuntimeError, match="use_reentrant=True") as info:
                dist_autograd.backward(context_id, [loss])
        return str(info.value)

    with open_world(WORLD, timeout=20) as world:
        assert "Error on Node 0" in (world.run(body)[0] or "")


@pytest.mark.parametrize("name", ["two_rpcs", "hooks", "sparse", "unused_result"])
def test_a_torch_without_edge_roots_runs_each_message_and_gives_torchs_gradients(
    name: str, distributed_calls: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch before 2.4 cannot start its engine at a node: each message runs at once (a
    shared node once per message, as distgrad did before) -- still torch's gradients."""
    programs.CALL = programs._local_call
    expected_grad, _ = _local(name)
    programs.CALL = rpc.rpc_sync
    monkeypatch.setattr(_pass, "edge_roots", lambda: False)
    with open_world(WORLD, timeout=20) as world:
        grad, _ = _distributed(world, name)
    torch.testing.assert_close(grad, expected_grad)


def _nested(w: torch.Tensor) -> torch.Tensor:
    """Two nodes that wait, one below the other, both fed by a run that cannot wait (it sends
    a recv function's gradient the other pending source depends on)."""
    low = w * 2  # b2
    high = low.exp()  # b1 -> b2
    back = rpc.rpc_sync("worker1", programs.scale, (high,))  # the pending source
    u1 = high * back  # live: reaches the recv of `back`
    u2 = low * back
    return rpc.rpc_sync("worker2", programs.scale, (u1 + u2,)).sum()


def test_nodes_that_wait_one_below_the_other_give_torchs_gradients() -> None:
    """The one shape where a node runs early with part of its gradient (``_plan._widen``):
    still torch's gradients."""
    w = _leaf()
    rpc_sync = rpc.rpc_sync
    rpc.rpc_sync = lambda to, fn, args: fn(*args)  # type: ignore[assignment,misc]
    try:
        (expected,) = torch.autograd.grad(_nested(w), [w])
    finally:
        rpc.rpc_sync = rpc_sync  # type: ignore[misc]

    def body(rank: int) -> torch.Tensor | None:
        if rank != 0:
            return None
        leaf = _leaf()
        with dist_autograd.context() as context_id:
            dist_autograd.backward(context_id, [_nested(leaf)])
            return dist_autograd.get_gradients(context_id)[leaf]

    with open_world(3, timeout=20) as world:
        got = world.run(body)[0]
    torch.testing.assert_close(got, expected)


def combine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a * 1.5 + b


def _scaled_hook(w: torch.Tensor) -> torch.Tensor:
    """An intermediate with a hook that scales its gradient, and a leaf with one, both sent and
    used again with the result: the run from the loss stops at them while their own gradient
    is pending (and must go on: it sends the gradient that the pending one depends on)."""
    h = w.exp()
    h.register_hook(lambda grad: grad * 2)
    leaf = _HOOKED_LEAF[0]
    back = rpc.rpc_sync("worker1", combine, (h, leaf))
    u = h * back + leaf * back
    return rpc.rpc_sync("worker2", programs.scale, (u,)).sum()


_HOOKED_LEAF: list[torch.Tensor] = []


def test_a_hook_that_scales_an_intermediate_where_a_run_stops_gives_torchs_gradients() -> None:
    """A node whose tensors have hooks is not captured (torch would call the hooks on the
    captured part and again on the whole): it runs on each part -- torch's gradients for a
    linear hook; a leaf's hooks, set aside while it waits, run once on its whole gradient."""
    torch.manual_seed(0)
    leaf = torch.randn(3, requires_grad=True)
    leaf.register_hook(lambda grad: grad * 3)
    _HOOKED_LEAF[:] = [leaf]
    w = _leaf()
    rpc_sync = rpc.rpc_sync
    rpc.rpc_sync = lambda to, fn, args: fn(*args)  # type: ignore[assignment,misc]
    try:
        expected = torch.autograd.grad(_scaled_hook(w), [w, leaf])
    finally:
        rpc.rpc_sync = rpc_sync  # type: ignore[misc]

    def body(rank: int) -> list[torch.Tensor] | None:
        if rank != 0:
            return None
        w = _leaf()
        with dist_autograd.context() as context_id:
            dist_autograd.backward(context_id, [_scaled_hook(w)])
            grads = dist_autograd.get_gradients(context_id)
            return [grads[w], grads[leaf]]

    with open_world(3, timeout=20) as world:
        got = world.run(body)[0]
    assert got is not None
    torch.testing.assert_close(got[0], expected[0])
    torch.testing.assert_close(got[1], expected[1])


def test_plan_captures_at_the_first_node_that_waits() -> None:
    """A run from a node above a blocked one captures the edge into it and executes nothing
    below it."""
    w = torch.randn(2, requires_grad=True)
    blocked = w.exp()
    top = blocked * 2 + w
    assert top.grad_fn is not None and blocked.grad_fn is not None
    add, exp = top.grad_fn, blocked.grad_fn  # (the node objects stay: ids are theirs)
    mul = add.next_functions[0][0]  # leads only into the blocked node: it waits too
    todo = _plan.plan([add], {id(exp): 1}, {})
    assert id(add) in todo.live
    assert id(mul) in todo.later and id(exp) in todo.later
    assert [(id(node), nr) for node, nr in todo.captures] == [(id(mul), 0)]
    assert set(todo.leaves) == {id(w)}
    assert not todo.partial


def _fails(x: torch.Tensor) -> torch.Tensor:
    return Boom.apply(x)


class Boom(torch.autograd.Function):
    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x * 1

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        raise ValueError("boom")


def test_a_failed_pass_is_quiet_afterwards(caplog: pytest.LogCaptureFixture) -> None:
    """A pass that fails on one worker while others still send: backward raises the chain, and
    the late messages log no error (only debug lines)."""

    def body(rank: int) -> str | None:
        if rank != 0:
            return None
        w = _leaf()
        with dist_autograd.context() as context_id:
            bad = rpc.rpc_sync("worker1", _fails, (w,))
            good = [rpc.rpc_sync(f"worker{k}", programs.scale, (w,)) for k in (2, 3, 2, 3)]
            loss = (bad + torch.stack(good).sum(0)).sum()
            with pytest.raises(RuntimeError, match="boom") as info:
                dist_autograd.backward(context_id, [loss])
        return str(info.value)

    with caplog.at_level(logging.DEBUG, logger="distgrad"), open_world(WORLD, timeout=20) as world:
        message = world.run(body)[0]
    assert message is not None and "Error on Node" in message
    errors = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert errors == [], [r.getMessage() for r in errors]
