"""The hook through which a layer above RPC rides along with calls.

Distributed autograd (layer 4) implements :class:`CallExtension` and installs it with
:func:`set_extension`; the RPC layer never imports it. When no extension is installed, a call
costs nothing extra.

The extension sees the tensors of every message (in message order) and returns an ``ext``
object that travels in the message's tensor table; on the receiving side it sees ``ext`` and
the received tensors *before* the payload is built around them, and may substitute them.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import NamedTuple, Protocol

import torch

__all__ = ["CallExtension", "CallRecord", "get_extension", "set_extension"]


class CallRecord(NamedTuple):
    """A message's ``ext``: what the layer above attaches to it (distributed autograd: the
    context the call belongs to, the message's autograd id, the sending worker)."""

    context_id: int
    message_id: int
    from_worker: int


class CallExtension(Protocol):
    """The layer above's part in calls. A callee's *state* for a request is the id of the
    context its function runs in (``None``: the request needs nothing)."""

    def active(self) -> bool:
        """Caller thread: whether outgoing requests need the extension at all now (when not,
        the message is pickled in one pass, its tensors inline)."""

    def outgoing_request(
        self, dst: int, tensors: list[torch.Tensor], force: bool
    ) -> CallRecord | None:
        """Caller thread, before sending a request: its ``ext`` (``None`` for none)."""

    def incoming_request(
        self, src: int, ext: CallRecord | None, tensors: list[torch.Tensor]
    ) -> tuple[list[torch.Tensor], int | None]:
        """Callee: the tensors to build the payload with, and a state for running the call
        (``None`` when the request needs nothing)."""

    def scope(self, state: int) -> AbstractContextManager[None]:
        """Callee: the context in which the user function runs."""

    def outgoing_response(
        self, state: int, dst: int, tensors: list[torch.Tensor]
    ) -> CallRecord | None:
        """Callee, before sending the response of a request that had a state: its ``ext``."""

    def incoming_response(
        self, src: int, ext: CallRecord | None, tensors: list[torch.Tensor]
    ) -> list[torch.Tensor]:
        """Caller, on a response with a tensor table: the tensors to build the result with."""

    def sent(self) -> None:
        """Sending thread, right after it wrote (or failed to write) a request or response
        that went through the extension: time for work deferred from the send (a caller is
        about to wait for its answer anyway, a callee is done with the call)."""


_extension: CallExtension | None = None


def set_extension(extension: CallExtension | None) -> None:
    global _extension
    _extension = extension


def get_extension() -> CallExtension | None:
    return _extension
