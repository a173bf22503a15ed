"""A graceful leave never waits for what already failed (issue 22 item 2): RRef forks carried
by requests that failed are settled, so a member whose calls with RRefs (RemoteModule's, an
RRef passed to its owner) just failed leaves in about its messages' round trips, not its
whole shutdown timeout ("N pending forks not settled in time"). On in-memory dynamic worlds."""

from __future__ import annotations

import time

import pytest
import torch

import distgrad.rpc as rpc
from distgrad._errors import PeerFailureError
from distgrad.testing import Fault, open_world, world_options

LEAVE_TIMEOUT = 8.0
QUICK = 2.0  # a leave's messages take milliseconds here; the timeout would be 8 s


def make_value() -> torch.Tensor:
    return torch.ones(2)


def use_rref(rref: rpc.RRef[torch.Tensor]) -> torch.Tensor:
    """Run on the owner (as RemoteModule's forward is)."""
    return rref.local_value() * 2


def _timed_leave(world: object, rank: int) -> float:
    started = time.monotonic()
    world.leave(rank, timeout=LEAVE_TIMEOUT)  # type: ignore[attr-defined]
    return time.monotonic() - started


def test_a_leave_does_not_wait_for_a_fork_whose_request_was_never_sent(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """worker0 passes an RRef owned by worker1 to worker1; the request cannot be written
    (twice: not sent), so the child fork can never be accepted. The leave is quick, and says
    nothing about pending forks."""
    options = world_options(rpc_timeout=5.0)
    faults = [Fault("break", function="use_rref", times=2)]
    with open_world(3, options=options, faults=faults, dynamic=True) as world:
        rref = world.run_on(0, rpc.remote, "worker1", make_value)
        assert torch.equal(world.run_on(0, rref.to_here), torch.ones(2))
        with pytest.raises(PeerFailureError, match="the request was not sent"):
            world.run_on(0, rpc.rpc_sync, "worker1", use_rref, (rref,))
        assert torch.equal(world.run_on(0, rpc.rpc_sync, "worker2", make_value), torch.ones(2))
        del rref
        with caplog.at_level("WARNING", logger="distgrad.rpc"):
            took = _timed_leave(world, 0)
        assert took < QUICK, took
        assert "not settled in time" not in caplog.text
        assert "not acknowledged in time" not in caplog.text


def test_a_leave_does_not_wait_for_a_fork_sent_to_an_owner_that_was_replaced(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """worker0's call carrying an RRef to its owner, worker1, fails: worker1 is frozen (the
    call fails as it is suspected), then killed before it read the request and relaunched
    under its name (a new incarnation). The old one will never accept the child fork; the
    leave is quick."""
    options = world_options(rpc_timeout=5.0, peer_timeout=0.5, heartbeat_interval=0.05)
    with open_world(3, options=options, faults=[], dynamic=True) as world:
        assert world.faults is not None
        rref = world.run_on(0, rpc.remote, "worker1", make_value)
        assert torch.equal(world.run_on(0, rref.to_here), torch.ones(2))
        world.faults.freeze(1)
        with pytest.raises(PeerFailureError, match="worker1"):
            world.run_on(0, rpc.rpc_sync, "worker1", use_rref, (rref,))
        world.kill(1)  # (what it held unread dies with it)
        world.join(1)  # relaunched: a new incarnation under the same name
        assert torch.equal(world.run_on(0, rpc.rpc_sync, "worker1", make_value), torch.ones(2))
        del rref
        with caplog.at_level("WARNING", logger="distgrad.rpc"):
            took = _timed_leave(world, 0)
        assert took < QUICK, took
        assert "not settled in time" not in caplog.text


def test_a_leave_does_not_wait_for_an_owner_that_stays_frozen(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """worker0's call carrying an RRef to its owner, worker1, fails because worker1 is frozen,
    and stays frozen while worker0 leaves: neither the child fork nor the delete of worker0's
    user is waited for (worker1's calls failed already), so the leave is quick."""
    options = world_options(rpc_timeout=5.0, peer_timeout=0.5, heartbeat_interval=0.05)
    with open_world(3, options=options, faults=[], dynamic=True) as world:
        assert world.faults is not None
        rref = world.run_on(0, rpc.remote, "worker1", make_value)
        assert torch.equal(world.run_on(0, rref.to_here), torch.ones(2))
        world.faults.freeze(1)
        with pytest.raises(PeerFailureError, match="worker1"):
            world.run_on(0, rpc.rpc_sync, "worker1", use_rref, (rref,))
        del rref
        with caplog.at_level("WARNING", logger="distgrad.rpc"):
            took = _timed_leave(world, 0)
        assert took < QUICK, took
        assert "not settled in time" not in caplog.text
        assert "not acknowledged in time" not in caplog.text
        world.faults.thaw(1)
        world.kill(1)
