"""Drop-in replacement for ``torch.distributed.autograd``:
``import distgrad.autograd as dist_autograd``.

Importing this module registers distributed autograd as a layer of distgrad's RPC layer
(forward recording of send/recv functions, the backward engine, context cleanup).
"""

from __future__ import annotations

import torch

from .._autograd import _context, _engine
from .._autograd._cleanup import after_release
from .._autograd._context import CONTAINER, DistAutogradContext, context
from .._autograd._engine import BackwardError
from .._autograd._layer import AutogradLayer
from .._rpc._core import register_layer

__all__ = ["BackwardError", "backward", "context", "get_gradients", "is_available"]


def is_available() -> bool:
    """Whether distributed autograd is available: always ``True``.

    Returns:
        bool: ``True``.
    """
    return True


def backward(context_id: int, roots: list[torch.Tensor], retain_graph: bool = False) -> None:
    """Run the backward pass from ``roots`` across every worker that took part in the
    context's forward pass (torch's ``dist_autograd.backward``).

    Blocks until the whole distributed pass has finished: the gradients travel back along
    every RPC recorded in the context (each send function gets its gradient, each worker runs
    torch's engine over its part of the graph as soon as a gradient message arrives). They
    accumulate in the context, on the worker that owns each leaf -- read them there with
    :func:`get_gradients`; ``.grad`` is not touched. Beyond torch, a pass also finishes when
    some RPC results of the context do not contribute to the loss (torch's waits forever).

    Args:
        context_id (int): the context, as given by ``with dist_autograd.context() as
            context_id``; it must exist on this worker.
        roots (list[Tensor]): the tensors to differentiate, each a scalar that requires grad
            (the loss); they get gradient 1.
        retain_graph (bool): keep the graph after the pass (as in ``torch.autograd.backward``)
            so that backward can run again in the same context; gradients keep accumulating.

    Raises:
        RuntimeError: the context does not exist on this worker ("Could not find autograd
            context with id: N"); a root does not require grad ("requires_grad not set on
            root") or is not a scalar ("... is not a scalar, all roots need to be scalar").
        BackwardError: the pass failed on some worker (a ``RuntimeError`` whose message chains
            the hops: "Error on Node 1: ..."); a worker that died during the pass is named
            within the failure-detection bound. The context survives: backward may be called
            again once the cause is gone.

    Example:
        # on worker 0 (worker1 serves)
        import torch
        import distgrad.autograd as dist_autograd
        import distgrad.rpc as rpc

        t1 = torch.rand((3, 3), requires_grad=True)
        t2 = torch.rand((3, 3), requires_grad=True)
        with dist_autograd.context() as context_id:
            loss = rpc.rpc_sync("worker1", torch.add, args=(t1, t2)).sum()
            dist_autograd.backward(context_id, [loss])
            grads = dist_autograd.get_gradients(context_id)
            grads[t1]  # tensor of ones, shape (3, 3); t1.grad stays None
    """
    _engine.backward(context_id, roots, retain_graph)


def get_gradients(context_id: int) -> dict[torch.Tensor, torch.Tensor]:
    """The gradients a backward pass accumulated in the context on this worker (torch's
    ``dist_autograd.get_gradients``).

    Each worker sees the gradients of the leaves it owns (its parameters, the tensors it sent
    that require grad); ask the owner of a leaf for its gradient (e.g. in a function called
    over RPC with the ``context_id``).

    Args:
        context_id (int): the context.

    Returns:
        dict[Tensor, Tensor]: ``{leaf tensor: its accumulated gradient}`` (empty before any
        backward pass). The dict is a snapshot; the gradient tensors belong to the context.

    Raises:
        RuntimeError: the context does not exist on this worker ("Could not find autograd
            context with id: N").

    Example:
        # on worker 0 (worker1 serves)
        t1 = torch.rand((3, 3), requires_grad=True)
        t2 = torch.rand((3, 3), requires_grad=True)
        with dist_autograd.context() as context_id:
            loss = rpc.rpc_sync("worker1", torch.add, args=(t1, t2)).sum()
            dist_autograd.backward(context_id, [loss])
            grads = dist_autograd.get_gradients(context_id)
            print(grads[t1], grads[t2])  # both all ones
    """
    return CONTAINER.retrieve_context(context_id).gradients()


def _new_context() -> DistAutogradContext:
    return CONTAINER.new_context()


def _release_context(context_id: int) -> None:
    after_release(CONTAINER.release_context(context_id))


def _retrieve_context(context_id: int) -> DistAutogradContext:
    return CONTAINER.retrieve_context(context_id)


def _current_context() -> DistAutogradContext:
    return CONTAINER.current_context()


def _is_valid_context(context_id: int) -> None:
    CONTAINER.retrieve_context(context_id)


def _get_max_id() -> int:
    return CONTAINER.max_id()


def _init(worker_id: int) -> None:
    CONTAINER.init(worker_id)


def _get_debug_info() -> dict[str, int]:
    return CONTAINER.debug_info()


_context.on_release = after_release
register_layer(AutogradLayer())  # (after init_rpc: started for the running agent at once)

context.__module__ = __name__
BackwardError.__module__ = __name__  # tracebacks show distgrad.autograd.BackwardError
