"""Drop-in replacement for ``torch.distributed.autograd``:
``import distgrad.autograd as dist_autograd``.

Importing this module installs distributed autograd into distgrad's RPC layer (forward
recording of send/recv functions, the backward engine, context cleanup).
"""

from __future__ import annotations

import torch

from .._autograd import _cleanup, _context, _engine
from .._autograd._cleanup import after_release
from .._autograd._context import CONTAINER, DistAutogradContext, context
from .._autograd._engine import BackwardError
from .._autograd._recording import AutogradRecording
from .._rpc import _api as _rpc_api
from .._rpc._agent import current_agent
from .._rpc._extension import set_extension
from .._rpc._messages import register_message_type
from .._rpc._rref import set_dist_backward

__all__ = ["BackwardError", "backward", "context", "get_gradients", "is_available"]


def is_available() -> bool:
    """Always True."""
    return True


def backward(context_id: int, roots: list[torch.Tensor], retain_graph: bool = False) -> None:
    """Run the backward pass from ``roots`` (scalars) across every worker of the context.

    Blocks until the whole distributed pass has finished. Gradients accumulate in the
    context on the worker owning each leaf (read them with :func:`get_gradients`); ``.grad``
    is never touched. With ``retain_graph=True`` the pass can be repeated and gradients keep
    accumulating. Errors arrive as ``RuntimeError`` with the chain ``Error on Node N: ...``.
    """
    _engine.install()
    _engine.backward(context_id, roots, retain_graph)


def get_gradients(context_id: int) -> dict[torch.Tensor, torch.Tensor]:
    """The gradients accumulated in the context on this worker, keyed by leaf tensor."""
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


def _on_rpc_init(rank: int) -> None:
    CONTAINER.init(rank)


for _handler in (_engine._grad_message, _engine._start_message, _engine._late_grad_message):
    register_message_type(_handler, "BACKWARD_AUTOGRAD_REQ")
register_message_type(_cleanup._cleanup_message, "CLEANUP_AUTOGRAD_CONTEXT_REQ")
set_extension(AutogradRecording())
set_dist_backward(backward)  # RRef.backward(context_id) on the owner
_context.on_release = after_release
if _on_rpc_init not in _rpc_api.init_hooks:
    _rpc_api.init_hooks.append(_on_rpc_init)
_agent = current_agent()
if _agent is not None:  # imported after init_rpc
    CONTAINER.init(_agent.worker_info.id)
    _engine.install()

context.__module__ = __name__
