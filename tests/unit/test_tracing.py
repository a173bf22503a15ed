"""Traces across workers (issue 30 item 3) on an in-memory world: a call's span on the caller
and on the callee linked by the traceparent in the request, nested calls children of the
callee's span; a backward pass one trace across the workers it reached; off by default."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import distgrad.autograd as dist_autograd
import distgrad.rpc as rpc
from distgrad._rpc._core import tracing
from distgrad._testing._world import open_world


def leaf(x: torch.Tensor) -> torch.Tensor:
    return x + 1


def middle(x: torch.Tensor) -> torch.Tensor:
    return rpc.rpc_sync("worker2", leaf, (x,)) * 2


def double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@pytest.fixture
def traced() -> Iterator[None]:
    was = tracing.active
    tracing.enable()
    try:
        yield
    finally:
        if not was:
            tracing.disable()


def test_parse_accepts_only_w3c_traceparents() -> None:
    good = "00-" + "a" * 32 + "-" + "b" * 16 + "-01"
    assert tracing.parse(good) == ("a" * 32, "b" * 16)
    for bad in (None, 3, "", good[:-1], "01" + good[2:], good.replace("-", "_")):
        assert tracing.parse(bad) is None


def test_nested_call_is_one_trace(traced: None) -> None:
    with open_world(3) as world:
        assert float(world.run_on(0, rpc.rpc_sync, "worker1", middle, (torch.zeros(1),))) == 2.0
    spans = [s for s in tracing.finished() if s.name.endswith(("middle", "leaf"))]
    by = {(s.worker, s.kind, s.name.rsplit(".", 1)[-1]): s for s in spans}
    caller = by[("worker0", "client", "middle")]
    callee = by[("worker1", "server", "middle")]
    nested = by[("worker1", "client", "leaf")]
    last = by[("worker2", "server", "leaf")]
    assert {s.trace_id for s in (caller, callee, nested, last)} == {caller.trace_id}
    assert caller.parent_id is None
    assert callee.parent_id == caller.span_id
    assert nested.parent_id == callee.span_id
    assert last.parent_id == nested.span_id
    assert caller.status == "ok" and callee.start_ns >= caller.start_ns  # (same host clock)
    assert caller.end_ns >= caller.start_ns and callee.end_ns >= callee.start_ns
    assert caller.attributes["rpc.peer"] == "worker1"


def test_failed_call_span_says_how(traced: None) -> None:
    with open_world(2) as world, pytest.raises(ZeroDivisionError):
        world.run_on(0, rpc.rpc_sync, "worker1", divmod, (1, 0))
    spans = [s for s in tracing.finished("worker0") if s.name.endswith("divmod")]
    assert spans and spans[-1].status == "remote"


def test_backward_pass_is_one_trace(traced: None) -> None:
    with open_world(2) as world:

        def job() -> None:
            x = torch.ones(4, requires_grad=True)
            with dist_autograd.context() as cid:
                y = rpc.rpc_sync("worker1", double, (x,))
                dist_autograd.backward(cid, [y.sum()])

        world.run_on(0, job)
    parts = [s for s in tracing.finished() if s.name.startswith("distgrad.autograd.backward")]
    root = [s for s in parts if s.parent_id is None and s.worker == "worker0"][-1]
    others = [s for s in parts if s.trace_id == root.trace_id and s is not root]
    assert any(s.worker == "worker1" and s.parent_id == root.span_id for s in others)
    # the gradient message to worker1 is a call of the same trace
    calls = [s for s in tracing.finished() if s.trace_id == root.trace_id and s.kind == "client"]
    assert calls and all(s.worker == "worker0" for s in calls)


def test_untraced_requests_carry_nothing() -> None:
    tracing.disable()
    before = len(tracing.finished())
    with open_world(2) as world:
        world.run_on(0, rpc.rpc_sync, "worker1", double, (torch.ones(1),))
    assert len(tracing.finished()) == before
