"""Unit tests of the agent's lifecycle state, ``__repr__`` and ``AgentStatistics`` on an
in-memory world."""

from __future__ import annotations

import pytest
import torch

import distgrad.rpc as rpc
from distgrad._rpc._core._statistics import AgentState, AgentStatistics
from distgrad._testing._world import open_world


def double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def fail() -> None:
    raise ValueError("no")


def test_statistics_count_calls_requests_and_bytes_per_peer() -> None:
    """Two calls (one failing) from worker0 to worker1 are counted on both sides, by peer
    name, with the tensor's bytes each way; nothing is left in flight."""
    tensor = torch.ones(1000)
    with open_world(2) as world:
        world.run_on(0, rpc.rpc_sync, "worker1", double, (tensor,))
        with pytest.raises(ValueError, match="no"):
            world.run_on(0, rpc.rpc_sync, "worker1", fail)
        caller = world.agents[0].agent_statistics()
        callee = world.agents[1].agent_statistics()
    assert isinstance(caller, AgentStatistics) and caller.state is AgentState.RUNNING
    to_callee = caller.peers["worker1"]
    assert (to_callee.calls_sent, to_callee.calls_failed) == (2, 1)
    assert to_callee.bytes_sent > tensor.nbytes and to_callee.bytes_received > tensor.nbytes
    from_caller = callee.peers["worker0"]
    assert (from_caller.requests_served, from_caller.requests_failed) == (2, 1)
    assert from_caller.bytes_received == to_callee.bytes_sent
    assert from_caller.bytes_sent == to_callee.bytes_received
    assert caller.calls_in_flight == 0 and caller.calls_sent == 2
    assert caller.transport is not None and caller.transport.dead_peers == ()


def test_state_and_repr_follow_the_agents_life() -> None:
    """An agent is RUNNING in its world, says so in its repr, and is STOPPED after it."""
    with open_world(2) as world:
        agent = world.agents[0]
        assert agent.state is AgentState.RUNNING
        assert repr(agent) == "<RpcAgent worker0 (rank 0 of 2) running, 0 calls in flight>"
    assert agent.state is AgentState.STOPPED and agent.state.stopped
    assert "stopped" in repr(agent)
    with pytest.raises(TypeError):
        agent.stop(True)  # type: ignore[misc]  # graceful is keyword-only
