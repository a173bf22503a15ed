"""Forward recording: which messages get send/recv functions (the reference's
``getMessageWithAutograd`` / ``addSendRpcBackward`` / ``addRecvRpcBackward``, SPEC 2.3).

Distributed autograd's call-recording hooks (``_layer``). A message is *wrapped* -- its ``ext`` is
a ``CallRecord(context_id, message_id, from_worker)`` -- when the sending thread has a current
context and either a tensor in it requires grad (under grad mode) or the call kind forces it
(Python functions, ``remote``, ``to_here``). A wrapped message adds its destination to the
context's known workers; if tensors require grad it also gets a send function here and a recv
function there. The callee runs the call with the caller's context as its current context.
"""

from __future__ import annotations

import threading
from contextlib import AbstractContextManager

import torch

from .._rpc._core import CallRecord, RpcLayer
from ._context import CONTAINER, DistAutogradContext
from ._functions import SendRecord, attach_recv, attach_send

__all__ = ["AutogradRecording"]


def _requires_grad(tensors: list[torch.Tensor]) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


class _Unwalked(threading.local):
    """Send functions created on this thread whose reach is not computed yet."""

    def __init__(self) -> None:
        self.records: list[SendRecord] = []


_unwalked = _Unwalked()


def _wrap(
    ctx: DistAutogradContext, dst: int, tensors: list[torch.Tensor], grad: bool
) -> CallRecord:
    msg_id = CONTAINER.new_autograd_message_id()
    if grad:
        needing = [t for t in tensors if t.requires_grad]
        record = attach_send(msg_id, dst, needing)
        ctx.add_send_function(msg_id, record)
        _unwalked.records.append(record)
    ctx.add_known_worker(dst)
    return CallRecord(ctx.context_id, msg_id, CONTAINER.worker_id)


def _attach(ext: CallRecord, tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], int]:
    context_id, msg_id, from_worker, device_map = ext
    ctx = CONTAINER.get_or_create_context(context_id)
    if tensors and _requires_grad(tensors):
        positions = [i for i, t in enumerate(tensors) if t.requires_grad]
        # the gradients go back by the inverse of the map the call came with (the seeds'
        # addRecvRpcBackward(..., reverseDeviceMap)); none: by this worker's own options
        reverse = {v: k for k, v in device_map.items()} if device_map else None
        record, attached = attach_recv(
            msg_id, from_worker, [tensors[i] for i in positions], reverse
        )
        ctx.add_recv_function(msg_id, record)
        tensors = list(tensors)
        for position, tensor in zip(positions, attached, strict=True):
            tensors[position] = tensor
    return tensors, int(context_id)


class AutogradRecording(RpcLayer):
    """Distributed autograd's hooks on the call path (the call-recording role)."""

    def active(self) -> bool:
        return CONTAINER.current_context_id() != -1

    def outgoing_request(
        self, dst: int, tensors: list[torch.Tensor], force: bool
    ) -> CallRecord | None:
        context_id = CONTAINER.current_context_id()
        if context_id == -1:
            return None
        grad = _requires_grad(tensors)
        if not grad and not force:
            return None
        return _wrap(CONTAINER.retrieve_context(context_id), dst, tensors, grad)

    def incoming_request(
        self, src: int, ext: CallRecord | None, tensors: list[torch.Tensor]
    ) -> tuple[list[torch.Tensor], int | None]:
        if ext is None:
            return tensors, None
        return _attach(ext, tensors)

    def scope(self, state: int) -> AbstractContextManager[None]:
        return CONTAINER.forced_current(state)

    def outgoing_response(
        self, state: int, dst: int, tensors: list[torch.Tensor]
    ) -> CallRecord | None:
        if not _requires_grad(tensors):
            return None
        ctx = CONTAINER.get_context(state)
        if ctx is None:  # released while the call ran
            return None
        return _wrap(ctx, dst, tensors, True)

    def incoming_response(
        self, src: int, ext: CallRecord | None, tensors: list[torch.Tensor]
    ) -> list[torch.Tensor]:
        if ext is None:
            return tensors
        return _attach(ext, tensors)[0]

    def sent(self) -> None:
        """Walk the graph below the send functions of the message just sent, now rather than
        when a backward pass starts: the caller waits for the answer anyway, the callee is
        done, and the walk is off the backward pass's critical path."""
        records = _unwalked.records
        if records:
            _unwalked.records = []
            for record in records:
                record.get_reach()
