"""Unit tests of the send and recv functions (``_autograd._functions``): their records keep
their autograd nodes alive on every torch (SPEC 1.2's ``_send_functions`` /
``_recv_functions`` introspection)."""

from __future__ import annotations

import gc

import torch

from distgrad._autograd._functions import RECV_NAME, SEND_NAME, attach_recv, attach_send, run_engine


def test_recv_node_outlives_the_dropped_rpc_result() -> None:
    """A recv record's node keeps its name and edges after the received tensors are dropped
    (torch 2.5-2.11 hold a Python grad_fn's C++ node only weakly: it used to die with them)."""
    received = [torch.ones(2, requires_grad=True), torch.zeros(3, requires_grad=True)]
    record, outputs = attach_recv(7, 1, received)
    assert [tuple(t.shape) for t in outputs] == [(2,), (3,)]
    assert all(t.grad_fn is record.node for t in outputs)
    del outputs, received
    gc.collect()
    assert record.node.name() == RECV_NAME
    assert len(record.edges) == 2
    assert record.anchor is not None and record.anchor.numel() == 0


def test_recv_edges_capture_the_gradients_of_the_received_tensors() -> None:
    """Gradients flowing into the recv node are captured at its edges, one per received
    tensor, whatever the anchor output adds to the node."""
    record, (a, b) = attach_recv(
        8, 1, [torch.ones(2, requires_grad=True), torch.ones(3, requires_grad=True)]
    )
    loss = (a * 3).sum() + (b * b).sum()
    grads = run_engine([loss], [torch.ones(())], record.edges, False)
    assert torch.equal(grads[0], torch.full((2,), 3.0))
    assert torch.equal(grads[1], torch.full((3,), 2.0))


def test_send_node_outlives_the_sent_tensors() -> None:
    """A send record's node keeps its name after the caller drops what it sent."""
    leaf = torch.ones(2, requires_grad=True)
    record = attach_send(9, 1, [leaf * 2])
    gc.collect()
    assert record.node.name() == SEND_NAME
    assert [fn.name() for fn, _ in record.node.next_functions] == ["MulBackward0"]
