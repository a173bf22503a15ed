"""What an agent's stages share: the few things that change as the agent runs (its state, its
transport once started, the default timeout), in one small object the agent creates and hands
to each stage (``_outgoing``, ``_oneway``, ``_serving``). Everything else a stage uses is given
to it when it is made, or is its own."""

from __future__ import annotations

from dataclasses import dataclass

from ..._errors import RpcShutdownError
from ..._transport._base import Transport
from ._statistics import AgentState
from ._worker_info import WorkerInfo

__all__ = ["Shared"]


@dataclass(eq=False, slots=True)
class Shared:
    """The agent's running state, read by its stages (written by the agent, and by
    ``rpc._set_rpc_timeout`` for :attr:`rpc_timeout`)."""

    #: this worker
    worker_info: WorkerInfo
    #: the default timeout of new calls (seconds; 0: none)
    rpc_timeout: float
    state: AgentState = AgentState.CREATED
    #: ``state.stopped``, kept beside it (read on every call's path: no property call)
    stopped: bool = False
    #: a stop without grace began: no response goes out any more, as from a worker that died
    #: (torch's agent "won't send response to request #N ... as the agent is shutting down"),
    #: so no answer made of this worker's own stop -- "RPC is no longer running on this node"
    #: -- reaches a peer, which sees the connection close instead
    silenced: bool = False
    #: the transport, once the agent started it
    transport: Transport | None = None
    #: whether the transport wants a ``MessageInfo`` with each frame (fault injection)
    describe: bool = False

    def stopped_error(self, kind: str) -> RpcShutdownError:
        """The error of a send of a message of ``kind`` after the agent began to stop."""
        return RpcShutdownError(
            f"Node {self.worker_info.id}tried to send() a message of type {kind} "
            "but RPC is no longer running on this node."
        )

    def peer_is_dead(self, dst: int) -> bool:
        """True once worker ``dst`` is known to be dead."""
        transport = self.transport
        return transport is not None and transport.is_dead(dst)
