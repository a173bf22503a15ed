"""Unit tests of in-memory worlds (``distgrad._testing._world``, ``_transport/_inmemory``): several
agents in one process, over the real pickler, frame parser and threads, without sockets."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import torch

import distgrad.autograd as dist_autograd
import distgrad.rpc as rpc
from distgrad._autograd._context import CONTAINER
from distgrad._errors import PeerFailureError
from distgrad._rpc._core._agent import current_agent
from distgrad._rpc._rrefs._rref_context import context_of
from distgrad._testing._world import WorldTimeout, open_world, world_options
from distgrad._wire._frames import Kind


def add(a: torch.Tensor | int, b: torch.Tensor | int) -> torch.Tensor | int:
    return a + b


def whoami() -> str:
    agent = current_agent()
    assert agent is not None
    return agent.worker_info.name


def agent_threads() -> list[str]:
    return [
        t.name
        for t in threading.enumerate()
        if t.name.startswith(("distgrad-worker", "distgrad-callback", "distgrad-io"))
    ]


@pytest.fixture(autouse=True)
def no_agent_thread_left() -> Iterator[None]:
    """Every agent a test starts is stopped, with its threads, when the test ends."""
    before = set(agent_threads())
    yield
    deadline = time.monotonic() + 5.0
    while set(agent_threads()) - before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not set(agent_threads()) - before


def test_every_worker_reaches_every_other_and_itself() -> None:
    """Calls between all pairs (self included) run on the callee, whose agent is its own."""
    with open_world(3) as world:
        got = world.run(lambda r: [rpc.rpc_sync(f"worker{d}", whoami) for d in range(3)])
    assert got == [["worker0", "worker1", "worker2"]] * 3


def test_tensors_cross_by_value() -> None:
    """A tensor sent and returned is a copy (as over a socket), equal to what was sent."""

    def echo(rank: int) -> bool:
        sent = torch.arange(10_000, dtype=torch.float32)
        back = rpc.rpc_sync(f"worker{(rank + 1) % 2}", add, args=(sent, 0))
        return bool(torch.equal(back, sent)) and back.data_ptr() != sent.data_ptr()

    with open_world(2) as world:
        assert world.run(echo) == [True, True]


def _chain_step(rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """worker0 sends a leaf through every other worker in turn; backward from the result."""
    if rank != 0:
        return None
    torch.manual_seed(0)
    w = torch.randn(4, requires_grad=True)
    with dist_autograd.context() as context_id:
        x = w
        for dst in range(1, world_size):
            x = rpc.rpc_sync(f"worker{dst}", torch.mul, args=(x, float(dst + 1)))
        loss = (x * x).sum()
        dist_autograd.backward(context_id, [loss])
        grad = dist_autograd.get_gradients(context_id)[w]
    local = w.detach().clone().requires_grad_()
    y = local
    for dst in range(1, world_size):
        y = y * float(dst + 1)
    (y * y).sum().backward()
    assert local.grad is not None
    return grad, local.grad


def test_a_four_worker_backward_matches_local_autograd() -> None:
    """A distributed backward across four in-memory workers gives torch's local gradients, and
    every worker's contexts are released afterwards."""
    with open_world(4) as world:
        result = world.run(_chain_step, 4)[0]
        assert result is not None
        torch.testing.assert_close(result[0], result[1])
        # the cleanup is one-way: wait for it to reach every worker
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            if world.run(lambda r: CONTAINER.num_contexts()) == [0, 0, 0, 0]:
                break
            time.sleep(0.01)
        assert world.run(lambda r: CONTAINER.num_contexts()) == [0, 0, 0, 0]


def test_each_worker_has_its_own_autograd_container() -> None:
    """The container a worker's thread sees is that worker's (ids carry its rank)."""
    with open_world(2) as world:
        ids = world.run(lambda r: CONTAINER.worker_id)
    assert ids == [0, 1]
    with pytest.raises(RuntimeError, match="initialize distributed autograd"):
        CONTAINER.worker_id  # noqa: B018  (this thread belongs to no worker, nor did init)


def test_rrefs_across_workers_leave_the_tables_empty() -> None:
    """remote(), to_here() and an RRef passed to a third worker work, and after a graceful
    shutdown's deletes no owner keeps a value or a fork."""

    def use(rank: int) -> float | None:
        if rank != 0:
            return None
        rref = rpc.remote("worker1", torch.add, args=(torch.ones(2), 1))
        total = rpc.rpc_sync("worker2", _fetch_sum, args=(rref,))
        assert torch.equal(rref.to_here(), torch.full((2,), 2.0))
        return float(total)

    with open_world(3) as world:
        assert world.run(use)[0] == 4.0
        del use
        agents = world.agents
    for agent in agents:
        info = context_of(agent).debug_info()
        assert info["num_owner_rrefs"] == "0" and info["num_forks"] == "0", info


def _fetch_sum(rref: rpc.RRef[torch.Tensor]) -> torch.Tensor:
    return rref.to_here().sum()


def test_a_killed_worker_fails_calls_to_it_promptly() -> None:
    """Calls to a worker that died fail with a PeerFailureError naming it, not a timeout."""
    with open_world(2) as world:
        world.kill(1)
        started = time.monotonic()
        with pytest.raises(PeerFailureError, match="worker1"):
            world.run_on(0, rpc.rpc_sync, "worker1", add, (1, 2))
        assert time.monotonic() - started < 5.0


#: an allowance for load on top of a detection bound (as tests/e2e/test_failure_bound.py)
SLACK_S = 1.5


def test_a_silent_peer_is_suspected_between_the_peer_timeout_and_a_heartbeat_later() -> None:
    """A worker that stops answering (its I/O thread blocked) is suspected, not condemned: the
    call waiting on it fails saying so no sooner than ``peer_timeout`` after the peer went
    silent and within ``peer_timeout + heartbeat_interval`` (+1.5 s for load) of it, the caller
    does not take it for dead, and once it answers again a later call reaches it."""
    blocked = threading.Event()
    release = threading.Event()
    heartbeat, peer_timeout = 0.05, 0.5

    def stall() -> None:
        blocked.set()
        release.wait(10)

    options = world_options(heartbeat_interval=heartbeat, peer_timeout=peer_timeout, rpc_timeout=0)
    with open_world(2, options=options) as world:
        world.run_on(0, rpc.rpc_sync, "worker1", add, (1, 2))  # the link is open (a fresh
        # one would fail at its handshake, which worker1's I/O thread would answer)
        agent1 = world.agents[1]
        agent1._io.call_soon(stall)  # worker1's I/O thread stops reading and beating
        assert blocked.wait(5)
        silent = time.monotonic()  # its last beat went at most a heartbeat interval before
        try:
            with pytest.raises(PeerFailureError, match="suspected"):
                world.run_on(0, rpc.rpc_sync, "worker1", add, (1, 2))
            took = time.monotonic() - silent
            assert peer_timeout - heartbeat <= took < peer_timeout + heartbeat + SLACK_S, took
            assert world.agents[0].statistics().dead_peers == ()
        finally:
            release.set()
        assert world.run_on(0, rpc.rpc_sync, "worker1", add, (1, 2)) == 3


def test_an_oversized_frame_drops_the_link_but_does_not_condemn_its_sender() -> None:
    """A frame over the receiver's limit is a protocol error: the receiver closes that link
    but does not take the sender for dead -- its own calls to the sender still work."""
    options = world_options()
    options.max_message_size = 1 << 16
    with open_world(2, options=options) as world:
        world.run_on(0, rpc.rpc_sync, "worker1", add, (1, 2))  # opens the link 0 -> 1
        link = world.agents[0].transport.connection(1)
        link.send_frame(Kind.REQUEST, 999, b"x" * (options.max_message_size + 1))
        deadline = time.monotonic() + 5.0
        while not link.closed and time.monotonic() < deadline:
            time.sleep(0.005)
        assert link.closed
        receiver = world.agents[1].statistics()
        assert receiver.protocol_errors == 1 and receiver.dead_peers == ()
        assert world.run_on(1, rpc.rpc_sync, "worker0", add, (1, 2)) == 3
        world.kill(0)  # (worker0 took the closed link for worker1's death, as over a socket)


_release = threading.Event()


def wait_for_release() -> None:
    _release.wait(30)


def test_a_worker_that_does_not_finish_is_reported_not_waited_for() -> None:
    """World.run is bounded: a worker stuck past the timeout raises WorldTimeout with its
    stack, and stopping the world ends the stuck call."""

    def stuck(rank: int) -> None:
        if rank == 0:
            rpc.rpc_sync("worker1", wait_for_release, timeout=0)

    _release.clear()
    try:
        with open_world(2, timeout=0.5) as world:
            with pytest.raises(WorldTimeout, match=r"(?s)workers \[0\].*rpc_sync"):
                world.run(stuck)
            _release.set()
            world.kill(1)
    finally:
        _release.set()
