"""The messages of a distributed backward pass and its error (what ``_pass`` sends and the
handlers in ``_engine`` take)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from .._errors import DistgradError

__all__ = [
    "BackwardError",
    "GradMessage",
    "GradUpdate",
    "PassMessages",
    "done_future",
]


class BackwardError(DistgradError):
    """A distributed backward pass failed (a ``RuntimeError``, as torch's error).

    The message is the hop-by-hop chain, each worker prefixing ``Error on Node N: `` as the
    error travels back to the caller of ``backward``, e.g. ``Error on Node 0: Error on Node 1:
    boom``. The context survives the failure."""

    verbatim_over_rpc = True


def done_future() -> torch.futures.Future[None]:
    """A future that is already complete (the answer to a message that needs no wait)."""
    future: torch.futures.Future[None] = torch.futures.Future()
    future.set_result(None)
    return future


class GradUpdate(NamedTuple):
    """Gradients for one send function of a pass (or, with ``grads`` None, only its final
    marker): what the driving thread's queue and :meth:`Pass.on_grad_messages` take."""

    msg_id: int
    grads: list[torch.Tensor] | None
    #: the last message for this send function: ``total`` messages carried gradients
    final: bool
    total: int


class GradMessage(NamedTuple):
    """A gradient message between workers (the one argument of ``_grad_message`` and
    ``_late_grad_message``): the updates for every send function of ``src``'s peer that one
    engine run (or one flush of final markers) on ``src`` produced, in one message."""

    context_id: int
    pass_id: tuple[int, int]
    retain: bool
    src: int
    updates: tuple[GradUpdate, ...]


class PassMessages(NamedTuple):
    """The handlers of a pass's messages to its peers: the engine's (``_engine`` makes every
    pass with them; ``_pass`` is below it and never imports it)."""

    #: ``(context_id, pass_id, retain, src)``: join a worker that gets no gradient message
    start: Callable[..., Any]
    #: a first gradient message to a worker (answered when that worker's part is done)
    grad: Callable[..., Any]
    #: a later one (one-way)
    late_grad: Callable[..., Any]
