"""RRefs plug into the agent as a layer (``_core._layer``), as distributed autograd does: the
agent core imports nothing of this package.

The layer tracks references (:attr:`~RpcLayer.tracks_references`): while a request is
unpickled on a worker thread it collects the UserRRefs that arrive with it and are not
confirmed by their owner yet, and the agent runs the request's function only once they are
(the reference runs no user function before that); a request that fails before its function
runs gives its error to the value its ``remote()`` creates. When an agent stops, its RRef
tables are destroyed and the forks still registered kept as leaks (``shutdown`` reports them).

:func:`register` plugs RRefs in (idempotent): the layer, and the reducer that forks an RRef
sent through RPC. ``init_rpc``'s module calls it when imported.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, ClassVar, cast

from ..._errors import RpcTimeoutError, rpc_timeout_message
from ..._wire._pickler import register_reducer
from .._core import LayerAgent, RpcAgent, RpcLayer, register_layer
from ._rref import BY_HAND, RRef
from ._rref_context import RRefContext, context_of, stop_context
from ._rref_fork import _reduce_rref, deserialize_rref, serialize_rref

__all__ = ["RRefLayer", "register"]


class RRefLayer(RpcLayer):
    """The RRef protocol's part in serving requests, and its tables' end with the agent."""

    name: ClassVar[str] = "rrefs"
    tracks_references: ClassVar[bool] = True

    # The tables' own functions, not methods that call them: they run for every request served.
    # (``stop_collecting`` takes back only what ``start_collecting`` returned.)
    start_collecting = staticmethod(RRefContext.start_collecting)
    stop_collecting = staticmethod(RRefContext.stop_collecting)  # type: ignore[assignment]

    def metrics(self, agent: LayerAgent) -> Mapping[str, float]:
        info = context_of(cast(RpcAgent, agent)).debug_info()
        return {
            "rrefs_owned": int(info["num_owner_rrefs"]),
            "rref_forks_pending": int(info["num_forks"]),
            "rref_users_pending": int(info["num_pending_users"]),
        }

    def wait_usable(self, collected: list[Any], timeout: float | None) -> None:
        deadline = time.monotonic() + timeout if timeout is not None else None
        for rref in collected:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not rref._settled.wait(left):
                raise RpcTimeoutError(rpc_timeout_message(timeout or 0.0))
            rref._check_usable()

    def fail_unrun(self, agent: LayerAgent, error: BaseException) -> bool:
        assert isinstance(agent, RpcAgent)
        return context_of(agent).fail_creation(error)

    def on_agent_stop(self, agent: LayerAgent) -> None:
        assert isinstance(agent, RpcAgent)
        stop_context(agent)


_LAYER = RRefLayer()


def register() -> None:
    """Plug RRefs into RPC (idempotent)."""
    register_reducer(RRef, _reduce_rref)
    BY_HAND.serialize, BY_HAND.deserialize = serialize_rref, deserialize_rref
    register_layer(_LAYER)
