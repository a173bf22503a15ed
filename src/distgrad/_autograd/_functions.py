"""The send and recv functions: the autograd nodes distgrad adds to torch's local graph.

``SendRpcBackward`` sits in the sender's graph above the tensors of one outgoing message that
require grad (its next edges are their gradient edges, in message order). ``RecvRpcBackward``
is the ``grad_fn`` of every grad-requiring tensor received in one message. Both are
``torch.autograd.Function`` nodes, so torch's own engine runs the local graph around them;
distgrad's engine (``_engine``) decides when:

* a gradient message for a send function runs torch's engine from that node's outputs;
* the gradients flowing *into* a recv function are captured at its edges (``GradientEdge``)
  and shipped to the sender; the recv node itself never executes (its ``backward`` raises,
  which also stops a local ``loss.backward()`` from silently ignoring remote parts).
"""

from __future__ import annotations

import contextvars
import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd.graph import GradientEdge

__all__ = [
    "Reach",
    "RecvRecord",
    "RecvRpc",
    "SendRecord",
    "SendRpc",
    "reach_of",
    "run_engine",
]

_ENGINE: Any = torch.autograd.Variable._execution_engine  # type: ignore[attr-defined]
# Stashed only where it can also be removed (torch's own wrapper does both where both exist):
# a context left in a thread's map is destroyed when that thread exits, without the GIL -- on
# torch 2.11 (which has the stash but not the removal) the pool threads of a stopping agent
# crashed the process (SIGSEGV).
_UNSTASH: Any = getattr(torch._C, "_remove_obj_from_tls", None)
_STASH: Any = getattr(torch._C, "_stash_obj_in_tls", None) if _UNSTASH is not None else None


def run_engine(
    roots: Sequence[torch.Tensor | GradientEdge],
    grads: Sequence[torch.Tensor],
    inputs: Sequence[torch.Tensor | GradientEdge],
    retain_graph: bool,
) -> tuple[torch.Tensor | None, ...]:
    """``torch.autograd.grad(roots, inputs, grads, retain_graph, allow_unused=True)``, straight
    into torch's engine. The Python wrapper's argument checks cost more than a small engine run
    (about 60 of 110 µs for one ``Linear``-sized node); the engine checks each root gradient's
    shape and dtype against its root itself. The contextvars stash is what the wrapper does so
    that device threads see the compiler's configuration."""
    if _STASH is None:
        return _ENGINE.run_backward(  # type: ignore[no-any-return]
            tuple(roots), tuple(grads), retain_graph, False, tuple(inputs), True, False
        )
    _STASH("context", contextvars.copy_context())
    try:
        return _ENGINE.run_backward(  # type: ignore[no-any-return]
            tuple(roots), tuple(grads), retain_graph, False, tuple(inputs), True, False
        )
    finally:
        _UNSTASH("context")


@functools.cache
def edge_roots() -> bool:
    """True if torch's engine starts from ``GradientEdge`` roots (torch 2.4 and later): a
    gradient message then runs the engine from the send function's next edges, and the send
    function itself -- a Python node, about 12 µs -- never runs."""
    # (first called when a send function is recorded: maybe inside no_grad or inference mode)
    with torch.inference_mode(False), torch.enable_grad():
        leaf = torch.zeros(1, requires_grad=True)
        node = (leaf * 1).grad_fn
        if node is None:
            return False
        try:
            (grad,) = run_engine([GradientEdge(node, 0)], [torch.ones(1)], [leaf], False)
        except (TypeError, RuntimeError):
            return False
    return grad is not None and bool(grad.eq(1).all())


_C_APPLY: Any = torch._C._FunctionBase.__dict__["apply"]  # what Function.apply ends in
_FUNCTORCH_ACTIVE: Any = getattr(torch._C, "_are_functorch_transforms_active", None)
_UNWRAP_IF_DEAD: Any = getattr(getattr(torch._C, "_functorch", None), "unwrap_if_dead", None)


def _applier(function: type[torch.autograd.Function]) -> Any:
    """``function.apply`` without its Python wrapper where that wrapper does nothing but unwrap
    dead functorch wrappers (no functorch transform active: the usual case): its checks cost
    about a third of a one-tensor apply (9 against 14 µs in a loop)."""
    direct = _C_APPLY.__get__(None, function)
    wrapped: Any = function.apply
    if _FUNCTORCH_ACTIVE is None or _UNWRAP_IF_DEAD is None:  # an older torch: its own path
        return wrapped

    def apply(*tensors: torch.Tensor) -> Any:
        if _FUNCTORCH_ACTIVE():
            return wrapped(*tensors)  # (which explains that it is not supported)
        return direct(*map(_UNWRAP_IF_DEAD, tensors))

    return apply


class SendRpc(torch.autograd.Function):
    """Forward: identity over the message's grad-requiring tensors. Node:
    ``torch::distributed::autograd::SendRpcBackward`` (torch's name)."""

    @staticmethod
    def forward(ctx: Any, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(t.detach() for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return grads


class RecvRpc(torch.autograd.Function):
    """Forward: identity over received tensors, plus one empty *anchor* tensor. Node:
    ``torch::distributed::autograd::RecvRpcBackward`` (torch's name).

    The anchor is what keeps the node alive for the context. A Python ``grad_fn`` object holds
    its C++ node only weakly on torch 2.5-2.11 (a tensor or a later node holds it strongly), so
    once the RPC result is dropped the recorded node would die and ``grad_fn.name()`` raise
    "Attribute 'name' is invalid for this instance of _C._FunctionBase". The send side keeps
    its outputs for this; keeping the received tensors would also keep their memory until the
    context closes, so the recv side keeps a zero-element output of the same node instead. It
    never gets a gradient (nothing uses it), and the node never runs (see ``backward``).
    """

    @staticmethod
    def forward(ctx: Any, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # detach(): new tensors on the same memory, not views (a view returned by an
        # autograd.Function could not be modified in place; these go to the user)
        return (*(t.detach() for t in tensors), tensors[0].new_empty(0))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[None, ...]:
        raise RuntimeError(
            "RecvRpcBackward was reached by a local backward pass. Graphs that contain RPC "
            "results must be differentiated with distgrad.autograd.backward(context_id, roots)."
        )


# torch's C++ node names: what ``grad_fn.name()`` returns (tools and tests compare them)
SEND_NAME = "torch::distributed::autograd::SendRpcBackward"
RECV_NAME = "torch::distributed::autograd::RecvRpcBackward"
SendRpc._backward_cls.__name__ = SEND_NAME  # type: ignore[attr-defined]
RecvRpc._backward_cls.__name__ = RECV_NAME  # type: ignore[attr-defined]

_apply_send = _applier(SendRpc)
_apply_recv = _applier(RecvRpc)


@dataclass(eq=False, slots=True)
class Reach:
    """What a backward run from some nodes reaches in the local graph: every node (by id; the
    dict keeps the node objects, so the ids stay theirs), the leaves (``AccumulateGrad``
    variables, by id), their ``AccumulateGrad`` nodes (by the variable's id) and the recv
    nodes (by id) where the run stops."""

    nodes: dict[int, Any]
    leaves: dict[int, torch.Tensor]
    recv_nodes: list[int]
    accumulators: dict[int, Any] = field(default_factory=dict)


_ACCUMULATE_GRAD: type = torch._C._functions.AccumulateGrad  # type: ignore[attr-defined]


def reach_of(roots: list[Any]) -> Reach:
    """Walk the local graph down from ``roots`` (graph nodes) to leaves and recv nodes."""
    recv_type = RecvRpc._backward_cls  # type: ignore[attr-defined]
    nodes: dict[int, Any] = {}
    leaves: dict[int, torch.Tensor] = {}
    accumulators: dict[int, Any] = {}
    recv_nodes: list[int] = []
    stack = list(roots)
    while stack:
        node = stack.pop()
        if node is None:
            continue
        key = id(node)
        if key in nodes:
            continue
        nodes[key] = node
        kind = type(node)
        if kind is recv_type:
            recv_nodes.append(key)
        elif kind is _ACCUMULATE_GRAD:
            variable = node.variable
            leaves[id(variable)] = variable
            accumulators[id(variable)] = node
        else:
            for edge in node.next_functions:
                stack.append(edge[0])
    return Reach(nodes, leaves, recv_nodes, accumulators)


@dataclass(eq=False)
class SendRecord:
    """A send function: its node, its outputs (they keep the node alive), the peer, and (once
    computed) what the graph below it reaches -- fixed from the send function's creation on,
    since a node's edges never change, so it is computed once, ideally right after the message
    went out (while the caller waits anyway), not when a backward pass needs it."""

    msg_id: int
    dst: int
    node: Any
    outputs: tuple[torch.Tensor, ...]
    reach: Reach | None = None
    roots: tuple[torch.Tensor | GradientEdge, ...] | None = None

    def get_roots(self) -> tuple[torch.Tensor | GradientEdge, ...]:
        """Where a gradient message starts the engine: below the send function where torch
        can (computed on the first gradient message, not on every forward RPC)."""
        roots = self.roots
        if roots is None:
            if edge_roots():
                roots = tuple(GradientEdge(fn, nr) for fn, nr in self.node.next_functions)
            else:
                roots = self.outputs
            self.roots = roots
        return roots

    def get_reach(self) -> Reach:
        reach = self.reach
        if reach is None:
            reach = self.reach = reach_of([self.node])
        return reach


@dataclass(eq=False)
class RecvRecord:
    """A recv function: its node, where gradients go, how to zero-fill missing ones, and the
    node's anchor output (it keeps the node alive: ``RecvRpc``)."""

    msg_id: int
    src: int
    node: Any
    edges: list[GradientEdge]
    templates: list[tuple[torch.Size, torch.dtype, torch.layout, torch.device]] = field(
        default_factory=list
    )
    #: the map gradients go back by (the inverse of the forward's), or None: the options'
    device_map: dict[torch.device, torch.device] | None = None
    anchor: torch.Tensor | None = None

    def fill(self, grads: list[torch.Tensor | None]) -> list[torch.Tensor]:
        """Zero-fill undefined gradients (the peer's send function needs all of them)."""
        out: list[torch.Tensor] = []
        for grad, (shape, dtype, layout, device) in zip(grads, self.templates, strict=True):
            if grad is not None:
                out.append(grad)
            elif layout == torch.sparse_coo:
                out.append(
                    torch.sparse_coo_tensor(
                        torch.empty((len(shape), 0), dtype=torch.long),
                        torch.empty((0,), dtype=dtype),
                        shape,
                    )
                )
            else:
                out.append(torch.zeros(shape, dtype=dtype, device=device))
        return out


def attach_send(msg_id: int, dst: int, tensors: list[torch.Tensor]) -> SendRecord:
    """Record a send function over ``tensors`` (all require grad)."""
    outputs = _apply_send(*tensors)
    return SendRecord(msg_id, dst, outputs[0].grad_fn, outputs)


def attach_recv(
    msg_id: int,
    src: int,
    tensors: list[torch.Tensor],
    device_map: dict[torch.device, torch.device] | None = None,
) -> tuple[RecvRecord, list[torch.Tensor]]:
    """Give ``tensors`` (received, requiring grad) one shared recv function; return the record
    and the tensors the receiver should see instead."""
    *outputs, anchor = _apply_recv(*tensors)
    node = anchor.grad_fn
    record = RecvRecord(
        msg_id,
        src,
        node,
        [GradientEdge(node, i) for i in range(len(outputs))],
        [(t.shape, t.dtype, t.layout, t.device) for t in tensors],
        device_map,
        anchor,
    )
    return record, outputs
