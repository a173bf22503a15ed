"""The owner's side of an RRef: the handlers its users' messages call (``to_here()``'s fetch,
the type query, ``backward``), and the agent lookups they share with ``RRef``."""

from __future__ import annotations

from typing import Any

import torch

from .._core import RpcAgent, async_execution, call_recorder, current_agent, message_type
from ._rref_context import GloballyUniqueId, OwnerValue, context_of

_NO_AGENT = (
    "Current RPC agent is not set! Did you initialize the RPC framework "
    "(e.g. by calling `rpc.init_rpc`)?"
)


def _agent_or_raise() -> RpcAgent:
    agent = current_agent()
    if agent is None:
        raise RuntimeError(_NO_AGENT)
    return agent


def _wait_blocking(agent: RpcAgent, value: OwnerValue) -> Any:
    """Wait for an owner value; a worker thread frees its pool slot meanwhile."""
    if value.done():
        return value.result()
    with agent.blocking():
        return value.wait()


def _owner_backward(value: Any, context_id: int, retain_graph: bool) -> None:
    if not isinstance(value, torch.Tensor):
        raise RuntimeError("RRef should contain a tensor for .backward()")
    if context_id == -1:
        torch.autograd.backward([value], retain_graph=retain_graph)
        return
    recorder = call_recorder()  # distributed autograd (RPC never imports it)
    if recorder is None:
        raise RuntimeError("distributed autograd is not available (import distgrad.autograd)")
    recorder.backward(context_id, [value], retain_graph)


# -- handlers (run on the owner) ---------------------------------------------------------------
def _owner_value(rref_id: GloballyUniqueId) -> OwnerValue:
    return context_of(_agent_or_raise()).get_or_create_owner(rref_id)


def _done_future() -> torch.futures.Future[None]:
    future: torch.futures.Future[None] = torch.futures.Future()
    future.set_result(None)
    return future


@message_type("PYTHON_RREF_FETCH_CALL")
@async_execution
def _rref_fetch(rref_id: GloballyUniqueId) -> torch.futures.Future[Any]:
    """``to_here()``: the value, once it is set."""
    return _owner_value(rref_id).as_future()


@message_type("SCRIPT_RREF_FETCH_CALL")
@async_execution
def _script_rref_fetch(rref_id: GloballyUniqueId) -> torch.futures.Future[Any]:
    """``to_here()`` of an RRef a builtin or TorchScript function created (torch names that
    fetch differently)."""
    return _owner_value(rref_id).as_future()


@async_execution
def _rref_typeof_on_owner(rref_id: GloballyUniqueId) -> torch.futures.Future[Any]:
    return _owner_value(rref_id).as_future(type)


@message_type("RREF_BACKWARD_REQ")
def _rref_backward_on_owner(rref_id: GloballyUniqueId, context_id: int, retain_graph: bool) -> None:
    agent = _agent_or_raise()
    _owner_backward(_wait_blocking(agent, _owner_value(rref_id)), context_id, retain_graph)
