"""Unit tests of how distgrad calls torch's engine (``distgrad._autograd._functions``): the
direct call matches ``torch.autograd.grad``, gradient messages start below the send function,
and the engine still refuses gradients of the wrong shape."""

from __future__ import annotations

import pytest
import torch
from torch.autograd.graph import GradientEdge

from distgrad._autograd import _functions
from distgrad._autograd._functions import (
    RecvRecord,
    SendRecord,
    attach_recv,
    attach_send,
    edge_roots,
    run_engine,
)

EDGE_ROOTS = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 4)


def test_edge_roots_probe_holds_under_no_grad_and_inference_mode() -> None:
    """The probe runs when the first send function is recorded, whatever the grad mode."""
    for mode in (torch.no_grad, torch.inference_mode):
        _functions.edge_roots.cache_clear()
        with mode():
            assert edge_roots() is EDGE_ROOTS
    _functions.edge_roots.cache_clear()


def _graph() -> tuple[torch.Tensor, torch.Tensor, RecvRecord, SendRecord]:
    """leaf -> recv -> (r * w + r) -> send, with a leaf w also sent directly."""
    received = torch.randn(3, 4).requires_grad_()
    recv, (r,) = attach_recv(1, 0, [received])
    w = torch.randn(3, 4, requires_grad=True)
    y = r * w + r
    send = attach_send(2, 0, [y, w, r])  # an intermediate, a leaf, a received tensor as is
    return w, r, recv, send


def test_a_gradient_message_run_matches_torch_autograd_grad() -> None:
    """From the send function's roots (its next edges where torch can), the captured gradients
    at the recv edges and the leaf equal what torch.autograd.grad gives from its outputs."""
    w, _r, recv, send = _graph()
    grads = [torch.randn(3, 4) for _ in range(3)]
    inputs: list[torch.Tensor | GradientEdge] = [w, *recv.edges]
    expected = torch.autograd.grad(
        send.outputs,
        inputs,
        grads,
        retain_graph=True,
        allow_unused=True,
    )
    if EDGE_ROOTS:
        assert all(isinstance(root, GradientEdge) for root in send.get_roots())
    got = run_engine(send.get_roots(), grads, inputs, True)
    assert len(got) == len(expected)
    for a, b in zip(got, expected, strict=True):
        assert a is not None and b is not None
        torch.testing.assert_close(a, b)


def test_the_engine_still_refuses_a_gradient_of_the_wrong_shape() -> None:
    """Without torch.autograd.grad's Python checks, a peer's malformed gradient still fails."""
    w, _r, recv, send = _graph()
    bad = [torch.randn(3, 3), torch.randn(3, 4), torch.randn(3, 4)]
    with pytest.raises(RuntimeError, match="invalid gradient at index 0"):
        run_engine(send.get_roots(), bad, [w, *recv.edges], True)


def test_received_tensors_may_be_modified_in_place_and_still_differentiate() -> None:
    """A recv function's outputs are new tensors on the received memory, not views: the user
    may change them in place (as with any tensor that came back from a call), and the gradient
    through the in-place op reaches the recv function's edge."""
    raw = torch.randn(3, 4)
    received = raw.clone().requires_grad_()
    recv, (r,) = attach_recv(1, 0, [received])
    assert r.grad_fn is recv.node and not r._is_view()
    assert r.untyped_storage().data_ptr() == received.untyped_storage().data_ptr()
    r.mul_(3)  # a view returned by an autograd.Function would raise here
    assert torch.equal(received.detach(), raw * 3)  # same memory
    w = torch.randn(3, 4, requires_grad=True)
    loss = (r * w).sum()
    (captured,) = run_engine([loss], [torch.ones(())], recv.edges, False)
    assert captured is not None
    torch.testing.assert_close(captured, w.detach() * 3)


def test_nodes_under_a_functorch_transform_fail_as_torch_says() -> None:
    """The direct apply is only taken with no functorch transform active; inside one, torch's
    own Function.apply runs and explains why it cannot (no setup_context)."""

    def f(x: torch.Tensor) -> torch.Tensor:
        attach_send(1, 0, [x])
        return x.sum()

    with pytest.raises(RuntimeError, match="setup_context"):
        torch.func.grad(f)(torch.randn(3))
