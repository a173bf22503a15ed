"""Dynamic groups and incarnations on the in-memory transport (``open_world(dynamic=True)``):
members join, leave, rejoin and restart; what depended on an old incarnation fails naming it."""

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
from distgrad._testing._world import World, open_world, world_options
from distgrad._transport._faulty import Fault


def whoami() -> str:
    agent = current_agent()
    assert agent is not None
    return agent.worker_info.name


def slow(seconds: float) -> int:
    time.sleep(seconds)
    return 1


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


def names(world: World, rank: int) -> list[str]:
    return world.run_on(rank, lambda: [w.name for w in rpc.members()])


def test_a_joiner_is_seen_by_every_member_and_calls_go_both_ways() -> None:
    """After join() returns, every member lists the joiner and calls work in both directions."""
    with open_world(2, dynamic=True) as world:
        rank = world.join()
        assert rank == 2
        for r in range(3):
            assert names(world, r) == ["worker0", "worker1", "worker2"]
            infos = world.run_on(r, lambda: rpc.api._get_current_rpc_agent().get_worker_infos())
            assert [w.id for w in infos] == [0, 1, 2]
        assert world.run_on(0, rpc.rpc_sync, "worker2", whoami) == "worker2"
        assert world.run_on(2, rpc.rpc_sync, "worker1", whoami) == "worker1"


def test_a_member_that_leaves_is_named_as_departed_and_may_rejoin() -> None:
    """After a graceful leave, calls to it fail at once naming it as departed (by name and by
    WorkerInfo); the others go on; the same name rejoins as a new incarnation and serves."""
    with open_world(3, dynamic=True) as world:
        info = world.run_on(0, rpc.get_worker_info, "worker2")
        old = world.agents[2].incarnation
        world.leave(2)
        assert names(world, 0) == ["worker0", "worker1"]
        assert names(world, 1) == ["worker0", "worker1"]
        with pytest.raises(RuntimeError, match=r"worker2 \(rank 2\) has left the RPC group"):
            world.run_on(0, rpc.rpc_sync, "worker2", whoami)
        started = time.monotonic()
        with pytest.raises(PeerFailureError, match=r"worker2 \(rank 2\) has left the RPC group"):
            world.run_on(0, rpc.rpc_sync, info, whoami)
        assert time.monotonic() - started < 5.0  # at once, not after the 10 s rpc_timeout
        # by rank too (what a backward pass's gradient message to it looks its peer up by)
        with pytest.raises(RuntimeError, match=r"worker2 \(rank 2\) has left the RPC group"):
            world.run_on(0, rpc.get_worker_info, 2)
        assert world.run_on(0, rpc.rpc_sync, "worker1", whoami) == "worker1"
        world.join(2)
        assert world.agents[2].incarnation != old
        assert world.run_on(0, rpc.rpc_sync, "worker2", whoami) == "worker2"
        assert world.run_on(2, rpc.rpc_sync, "worker0", whoami) == "worker0"


def test_a_restarted_member_fails_what_depended_on_its_old_incarnation() -> None:
    """A member killed and relaunched under its name: its old calls in flight and RRefs fail
    naming the restart; new calls reach the new incarnation."""
    with open_world(2, dynamic=True) as world:
        rref = world.run_on(0, lambda: rpc.remote("worker1", torch.ones, args=(2,)))
        assert torch.equal(world.run_on(0, rref.to_here), torch.ones(2))
        pending = world.run_on(0, lambda: rpc.rpc_async("worker1", slow, args=(5.0,)))
        old = world.agents[1].incarnation
        world.kill(1)
        world.join(1)
        assert world.agents[1].incarnation != old
        with pytest.raises(PeerFailureError, match="worker1"):
            pending.wait()
        with pytest.raises(PeerFailureError, match="restarted"):
            world.run_on(0, rref.to_here)
        assert world.run_on(0, rpc.rpc_sync, "worker1", whoami) == "worker1"
        # nothing of the old incarnation is accepted again
        assert world.agents[0].transport.note_incarnation(1, old) is False  # type: ignore[attr-defined]
        del rref


def test_membership_listeners_are_told_of_joins_and_departures() -> None:
    """A listener gets joined/left events naming the member, in order."""
    events: list[str] = []
    with open_world(2, dynamic=True) as world:
        world.run_on(0, rpc.add_membership_listener, lambda e: events.append(str(e)))
        world.join()
        world.leave(2)
        deadline = time.monotonic() + 5
        while len(events) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert events == ["worker2 (rank 2) joined", "worker2 (rank 2) left"]


def test_membership_api_rejects_bad_input() -> None:
    """A listener that is not callable, or removing one never added, is a clear error."""
    with open_world(1, dynamic=True) as world:
        with pytest.raises(TypeError, match="must be callable"):
            world.run_on(0, rpc.add_membership_listener, 3)
        with pytest.raises(ValueError, match="is not a membership listener"):
            world.run_on(0, rpc.remove_membership_listener, print)


def _step(rank: int, members: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Worker0 sends a leaf through every other member in turn; backward; local reference."""
    torch.manual_seed(len(members))
    w = torch.randn(4, requires_grad=True)
    with dist_autograd.context() as context_id:
        x = w
        for dst in members:
            x = rpc.rpc_sync(f"worker{dst}", torch.mul, args=(x, float(dst + 1)))
        dist_autograd.backward(context_id, [(x * x).sum()])
        grad = dist_autograd.get_gradients(context_id)[w]
    local = w.detach().clone().requires_grad_()
    y = local
    for dst in members:
        y = y * float(dst + 1)
    (y * y).sum().backward()
    assert local.grad is not None
    return grad, local.grad


def _tables(world: World) -> list[tuple[int, int, int]]:
    """(autograd contexts, RRef owners + forks, open links) of each running member."""

    def sizes(rank: int) -> tuple[int, int, int]:
        agent = current_agent()
        assert agent is not None
        info = context_of(agent).debug_info()
        return (
            CONTAINER.num_contexts(),
            int(info["num_owner_rrefs"]) + int(info.get("num_forks", 0)),
            agent.statistics().open_connections,
        )

    return world.run(sizes, ranks=world.alive())


def test_twenty_join_leave_cycles_keep_gradients_exact_and_tables_flat() -> None:
    """20 cycles of a member joining and leaving, with an autograd step through every member
    each time: gradients equal local autograd's; the long-lived members' tables (contexts,
    RRefs, links) and the process's threads do not grow."""
    with open_world(2, dynamic=True) as world:

        def cycle(n: int) -> None:
            world.join(2)
            rref = world.run_on(0, lambda: rpc.remote("worker2", torch.ones, args=(3,)))
            assert torch.equal(world.run_on(0, rref.to_here), torch.ones(3))
            del rref
            grad, local = world.run_on(0, _step, 0, [1, 2])
            torch.testing.assert_close(grad, local, msg=f"cycle {n}")
            grad, local = world.run_on(2, _step, 2, [0, 1])
            torch.testing.assert_close(grad, local, msg=f"cycle {n}, from the joiner")
            world.leave(2)

        cycle(0)  # warm-up: the pools start their threads on demand
        time.sleep(0.2)
        before = _tables(world)
        threads_before = len(threading.enumerate())
        names_before = sorted(t.name for t in threading.enumerate())
        for n in range(1, 21):
            cycle(n)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and _tables(world) != before:
            time.sleep(0.05)
        after = _tables(world)
        threads_after = len(threading.enumerate())
        print(f"tables (contexts, rrefs, links) before {before} after {after}")
        print(f"threads before {threads_before} after {threads_after}")
        print(names_before, sorted(t.name for t in threading.enumerate()))
        assert after == before
        # no thread of a departed member is left: one I/O thread per live member, and the live
        # members' pools within their bounds (they start threads on demand)
        io_threads = [t for t in threading.enumerate() if t.name == "distgrad-io"]
        assert len(io_threads) == len(world.alive()) == 2
        pools = world.agents[0].options.num_worker_threads * 2
        assert threads_after <= 1 + len(world.alive()) * (1 + pools)


def _train_remotely(rank: int, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """On a late joiner: a RemoteModule on worker0 trained by a DistributedOptimizer; the
    same training locally. Returns (remote weight, local weight)."""
    from distgrad.nn import RemoteModule
    from distgrad.optim import DistributedOptimizer

    torch.manual_seed(0)
    module = RemoteModule("worker0/cpu", torch.nn.Linear, args=(3, 1))
    local = torch.nn.Linear(3, 1)
    with torch.no_grad():
        weight, bias = (p.to_here() for p in module.remote_parameters())
        local.weight.copy_(weight)
        local.bias.copy_(bias)
    optimizer = DistributedOptimizer(torch.optim.SGD, module.remote_parameters(), lr=0.1)
    local_opt = torch.optim.SGD(local.parameters(), lr=0.1)
    for _ in range(steps):
        x = torch.randn(4, 3)
        with dist_autograd.context() as context_id:
            loss = module.forward(x).pow(2).sum()
            dist_autograd.backward(context_id, [loss])
            optimizer.step(context_id)
        local_opt.zero_grad()
        local(x).pow(2).sum().backward()
        local_opt.step()
    remote_weight = module.remote_parameters()[0].to_here()
    return remote_weight, local.weight.detach().clone()


def test_remote_module_and_optimizer_work_from_a_late_joiner() -> None:
    """A member that joined late trains a RemoteModule on the leader with the distributed
    optimizer, exactly as local training."""
    with open_world(1, dynamic=True) as world:
        world.join()
        remote, local = world.run_on(1, _train_remotely, 1, 3)
        torch.testing.assert_close(remote, local)


def test_a_member_dying_during_a_pass_fails_that_pass_only() -> None:
    """A member killed between forward and backward fails that backward pass, naming it; the
    next pass over the members left is exact."""

    def forward_then_kill(rank: int) -> str:
        w = torch.randn(3, requires_grad=True)
        with dist_autograd.context() as context_id:
            x = rpc.rpc_sync("worker1", torch.mul, args=(w, 2.0))
            x = rpc.rpc_sync("worker2", torch.mul, args=(x, 3.0))
            world.kill(2)
            with pytest.raises(dist_autograd.BackwardError) as failure:
                dist_autograd.backward(context_id, [x.sum()])
        return str(failure.value)

    with open_world(3, dynamic=True) as world:
        message = world.run_on(0, forward_then_kill, 0)
        assert "worker2" in message
        grad, local = world.run_on(0, _step, 0, [1])
        torch.testing.assert_close(grad, local)


class MortalStore:
    """A store client that dies with its process: after :meth:`die` every call fails."""

    def __init__(self, store: object) -> None:
        self._store = store
        self.dead = False

    def die(self) -> None:
        self.dead = True

    def __getattr__(self, name: str) -> object:
        if self.dead:
            raise RuntimeError("the process of this store client is dead")
        return getattr(self._store, name)


def _holder(world: World) -> str | None:
    import json

    if not world.store.check(["distgrad/membership"]):
        return None
    lease = json.loads(bytes(world.store.get("distgrad/membership")))["lease"]
    return None if lease is None else str(lease["holder"])


@pytest.mark.parametrize("next_rank", [4, 3], ids=["another-joiner", "the-same-relaunched"])
def test_a_member_that_dies_holding_the_membership_token_does_not_stop_joins(
    next_rank: int,
) -> None:
    """A joiner killed mid-join (it told worker0, then waited on a frozen worker1, holding the
    token) does not block later joins: the next joiner (another, or the same rank relaunched)
    takes the token over within the lease's bound, undoes the half-applied join, and every
    member's view ends the same; calls reach the new member both ways."""
    with open_world(3, dynamic=True, faults=[]) as world:
        assert world.faults is not None
        world.faults.freeze(1)
        mortal = MortalStore(world.store)
        failed: list[BaseException] = []

        def doomed_join() -> None:
            try:
                world.join(3, store=mortal)
            except BaseException as exc:
                failed.append(exc)

        thread = threading.Thread(target=doomed_join, daemon=True)
        thread.start()
        deadline = time.monotonic() + 10
        while "worker3" not in names(world, 0) or _holder(world) != "worker3":
            assert time.monotonic() < deadline, "worker3 never held the token mid-join"
            time.sleep(0.01)
        mortal.die()  # the joiner's process dies: no renewal, no release
        world.kill(3)
        thread.join(10)
        assert failed and not thread.is_alive()
        world.faults.thaw(1)
        started = time.monotonic()
        world.join(next_rank)
        took = time.monotonic() - started
        assert took < 2 * world_options().peer_timeout + 2.0, took
        expected = ["worker0", "worker1", "worker2", f"worker{next_rank}"]
        for rank in world.alive():
            assert names(world, rank) == expected, rank
        assert _holder(world) is None
        grad, local = world.run_on(next_rank, _step, next_rank, [0, 1, 2])
        torch.testing.assert_close(grad, local)
        for rank in (0, 1, 2):
            name = f"worker{next_rank}"
            assert world.run_on(rank, rpc.rpc_sync, name, whoami) == name
        if next_rank != 3:
            with pytest.raises(RuntimeError, match="could not find destination name worker3"):
                world.run_on(0, rpc.rpc_sync, "worker3", whoami)


def test_a_leave_does_not_wait_for_other_members_to_drop_what_it_owns() -> None:
    """A member leaves at once while another still holds an RRef it owns (the holder cannot let
    go before it learns of the leave); the holder's RRef then fails naming it as departed."""
    with open_world(3, dynamic=True) as world:
        rref = world.run_on(0, lambda: rpc.remote("worker2", torch.ones, args=(2,)))
        assert torch.equal(world.run_on(0, rref.to_here), torch.ones(2))
        started = time.monotonic()
        world.leave(2)
        took = time.monotonic() - started
        assert took < 2.0, took  # before: the whole rpc_timeout (10 s here)
        with pytest.raises(PeerFailureError, match=r"worker2 \(rank 2\)"):
            world.run_on(0, rref.to_here)
        del rref


def test_a_member_that_dies_mid_leave_is_rolled_forward_by_the_next_holder() -> None:
    """A member killed mid-leave (it told worker0; its word to worker1 was lost, and it waits
    for the answer, holding the token) leaves all the same: the next joiner takes the token
    over and completes the leave, and every member's view ends the same (worker1's too)."""
    lost = Fault("drop", function="_member_left", src=2, dst=1)
    with open_world(3, dynamic=True, faults=[lost]) as world:
        mortal = MortalStore(world.store)
        world.agents[2].keepalive[0] = mortal  # the leaver's store client dies with it

        def doomed_leave() -> None:
            try:
                world.leave(2)
            except BaseException:
                pass

        thread = threading.Thread(target=doomed_leave, daemon=True)
        thread.start()
        deadline = time.monotonic() + 10
        while "worker2" in names(world, 0) or _holder(world) != "worker2":
            assert time.monotonic() < deadline, "worker2 never held the token mid-leave"
            time.sleep(0.01)
        time.sleep(0.2)  # (its word to worker1 is sent, and dropped)
        mortal.die()
        world.kill(2)
        thread.join(10)
        assert "worker2" in names(world, 1)  # half-applied: worker1 was never told
        world.join(3)
        expected = ["worker0", "worker1", "worker3"]
        for rank in (0, 1, 3):
            assert names(world, rank) == expected, rank
        assert _holder(world) is None
        with pytest.raises(RuntimeError, match=r"worker2 \(rank 2\) has left the RPC group"):
            world.run_on(1, rpc.rpc_sync, "worker2", whoami)


def test_a_call_to_a_departed_member_fails_at_once_while_its_link_is_still_open() -> None:
    """Once told a member leaves, a call to its WorkerInfo fails at once naming it as departed,
    even while the leaver, still telling others, has not closed its links yet."""
    lost = Fault("drop", function="_member_left", src=2, dst=1)  # the leave stays under way
    options = world_options(rpc_timeout=3.0)
    with open_world(3, dynamic=True, faults=[lost], options=options) as world:
        info = world.run_on(0, rpc.get_worker_info, "worker2")
        assert world.run_on(0, rpc.rpc_sync, info, whoami) == "worker2"  # a link is open
        thread = threading.Thread(target=world.leave, args=(2,), daemon=True)
        thread.start()
        deadline = time.monotonic() + 5
        while "worker2" in names(world, 0):
            assert time.monotonic() < deadline
            time.sleep(0.005)
        assert thread.is_alive()  # still waiting on worker1's answer
        with pytest.raises(PeerFailureError, match=r"worker2 \(rank 2\) has left the RPC group"):
            world.run_on(0, rpc.rpc_sync, info, whoami)
        thread.join(10)


def test_an_incarnation_removed_from_the_group_cannot_join_later() -> None:
    """A member told that an incarnation is gone (a join undone by the next holder of the
    membership token) refuses that incarnation's late word that it joined; a new incarnation
    of the same rank is welcome; telling the same join twice changes nothing."""
    from distgrad._rpc._core._worker_info import WorkerInfo
    from distgrad._transport._base import PeerAddress

    events: list[str] = []
    with open_world(1, dynamic=True) as world:
        agent = world.agents[0]
        world.run_on(0, rpc.add_membership_listener, lambda e: events.append(str(e)))
        late = PeerAddress("memory", 0, None, "h", incarnation=0xBAD)
        world.run_on(0, agent.remove_member, 5, 0xBAD, "its join was undone")
        with pytest.raises(RuntimeError, match=r"worker5 \(rank 5\) incarnation 0*bad was removed"):
            world.run_on(0, agent.add_member, WorkerInfo("worker5", 5), late)
        assert names(world, 0) == ["worker0"]
        fresh = PeerAddress("memory", 0, None, "h", incarnation=0x600D)
        world.run_on(0, agent.add_member, WorkerInfo("worker5", 5), fresh)
        world.run_on(0, agent.add_member, WorkerInfo("worker5", 5), fresh)  # asked again
        assert names(world, 0) == ["worker0", "worker5"]
        deadline = time.monotonic() + 5
        while not events and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)
        assert events == ["worker5 (rank 5) joined"]
