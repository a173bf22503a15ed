"""Distributed autograd as a layer of the RPC layer (``_rpc._core._layer``): it records calls
(forward recording, ``_recording``), names its messages, initialises the context container
when an agent starts, fails the passes that wait on a lost peer and runs ``RRef.backward``.
``distgrad.autograd`` registers it when imported."""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import torch

from .._rpc._core import LayerAgent
from . import _cleanup, _engine, _metrics
from ._context import CONTAINER
from ._recording import AutogradRecording

__all__ = ["AutogradLayer"]


class AutogradLayer(AutogradRecording):
    """The RPC layer's view of distributed autograd."""

    name: ClassVar[str] = "autograd"
    records_calls: ClassVar[bool] = True
    #: the containers keep ``recording`` (``_context._set_current``)
    counts_recording: ClassVar[bool] = True

    def message_types(self) -> Mapping[object, str]:
        handlers = (_engine._grad_message, _engine._start_message, _engine._late_grad_message)
        types: dict[object, str] = dict.fromkeys(handlers, "BACKWARD_AUTOGRAD_REQ")
        types[_cleanup._cleanup_message] = "CLEANUP_AUTOGRAD_CONTEXT_REQ"
        return types

    def on_agent_start(self, agent: LayerAgent) -> None:
        CONTAINER.init(agent.worker_info.id)

    def on_peer_failure(self, agent: LayerAgent, worker: int, error: Exception) -> None:
        _engine.on_peer_failure(worker, error)

    def metrics(self, agent: LayerAgent) -> Mapping[str, float]:
        figures: dict[str, float] = {}
        if CONTAINER.initialized:
            info = CONTAINER.debug_info()
            figures["autograd_contexts"] = info["num_autograd_contexts"]
            figures["backward_passes_running"] = info["num_current_backward_passes"]
        figures.update(_metrics.figures(agent.worker_info.id))
        return figures

    def backward(self, context_id: int, roots: list[torch.Tensor], retain_graph: bool) -> None:
        _engine.backward(context_id, roots, retain_graph)
