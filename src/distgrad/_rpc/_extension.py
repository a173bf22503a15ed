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
from typing import Any, Protocol

import torch

__all__ = ["CallExtension", "get_extension", "set_extension"]


class CallExtension(Protocol):
    def active(self) -> bool:
        """Caller thread: whether outgoing requests need the extension at all now (when not,
        the message is pickled in one pass, its tensors inline)."""

    def outgoing_request(self, dst: int, tensors: list[torch.Tensor], force: bool) -> Any:
        """Caller thread, before sending a request: its ``ext`` (``None`` for none)."""

    def incoming_request(
        self, src: int, ext: Any, tensors: list[torch.Tensor]
    ) -> tuple[list[torch.Tensor], Any]:
        """Callee: the tensors to build the payload with, and a state for running the call
        (``None`` when the request needs nothing)."""

    def scope(self, state: Any) -> AbstractContextManager[None]:
        """Callee: the context in which the user function runs."""

    def outgoing_response(self, state: Any, dst: int, tensors: list[torch.Tensor]) -> Any:
        """Callee, before sending the response of a request that had a state: its ``ext``."""

    def incoming_response(
        self, src: int, ext: Any, tensors: list[torch.Tensor]
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
