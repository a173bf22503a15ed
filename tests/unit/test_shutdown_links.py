"""Graceful shutdown across broken links (the flake of test_failure_bound's e2e test, seen in
CI): a link between two live members that breaks during the shutdown's gather -- its
request lost on the way, its answer lost, the result never delivered, one member frozen past
``peer_timeout`` and thawed -- gives up no one; every member shuts down gracefully (so does a
part or a result duplicated or late). The round
is run again under its key (a part sent twice counts once; a leader answers a part of a round
it finished with the result; a follower ignores a result it has; a leader sends the result
again to a follower that answers). A member that stays frozen ends the others' shutdown by
its timeout, no later. On in-memory worlds with fault injection."""

from __future__ import annotations

import time

import pytest

import distgrad.rpc as rpc
from distgrad._rpc._group import _collectives
from distgrad.testing import Fault, World, open_world, world_options

GATHER = "_gather_to_leader"
BROADCAST = "_broadcast_to_followers"

#: (what breaks, on whose link): worker0 leads (the smallest name)
FAULTS = {
    "part-lost-after-sending": Fault("lose", function=GATHER, src=1, nth=1),
    "part-not-sent-twice": Fault("break", function=GATHER, src=2, times=2),
    "result-not-sent-twice": Fault("break", function=BROADCAST, dst=1, times=2),
    "result-lost-after-sending": Fault("lose", function=BROADCAST, dst=2, nth=1),
    "second-gather-part-lost": Fault("lose", function=GATHER, src=1, nth=2),
    "part-duplicated": Fault("duplicate", function=GATHER, src=2, nth=1),
    "result-duplicated": Fault("duplicate", function=BROADCAST, dst=1, nth=1),
    "result-late": Fault("delay", function=BROADCAST, dst=2, nth=1, seconds=0.3),
}


@pytest.mark.parametrize("case", sorted(FAULTS))
def test_a_broken_link_between_live_members_does_not_fail_the_shutdown(case: str) -> None:
    fault = FAULTS[case]
    with open_world(3, faults=[fault], timeout=20) as world:
        assert world.faults is not None
        groups = [_collectives._groups(agent) for agent in world.agents]
    # (leaving the block shuts every member down gracefully: it raises if one failed)
    assert world.faults.fired(fault.action), case
    for each in groups:  # no round left behind
        assert each.states == {}, (case, each.states)


def _shut_down(world: World, rank: int, outcome: dict[int, str]) -> None:
    """``rpc.shutdown()`` of worker ``rank`` (the world does not shut it down again)."""
    try:
        world.leave(rank)
        outcome[rank] = "ok"
    except Exception as exc:
        outcome[rank] = repr(exc)


def test_a_member_frozen_in_its_shutdown_gives_up_no_one() -> None:
    """worker1 waits in shutdown (its part sent to worker0, the leader, still busy); worker1
    freezes past peer_timeout -- worker0 drops its link as silent -- and thaws: its own stall
    condemns no one: it waits on, and worker0 connects to it again; then worker0 and worker2
    shut down: all three do, gracefully."""
    options = world_options(heartbeat_interval=0.1, peer_timeout=0.5, rpc_timeout=0)
    with open_world(3, options=options, faults=[], timeout=30) as world:
        assert world.faults is not None
        world.run(lambda r: rpc.rpc_sync(f"worker{(r + 1) % 3}", min, (1, 2)))
        outcome: dict[int, str] = {}

        def member(rank: int) -> None:
            if rank != 1:
                time.sleep(0.3)  # worker1 is in its gather
                if rank == 0:
                    assert world.faults is not None
                    world.faults.freeze(1)
                    time.sleep(1.5)
                    world.faults.thaw(1)
                else:
                    time.sleep(1.5)
                time.sleep(0.3)
            _shut_down(world, rank, outcome)

        world.run(member, timeout=25)
        assert outcome == {0: "ok", 1: "ok", 2: "ok"}, outcome
        # the freeze did break the link: worker0 suspected worker1, worker1 reconnected
        events = world.agents[0].agent_statistics().transport
        assert events is not None
        assert any(e[:2] == (1, "suspected") for e in events.peer_events), events.peer_events
        assert any(e[:2] == (1, "recovered") for e in events.peer_events), events.peer_events


def test_a_member_that_stays_frozen_ends_the_others_shutdown_by_its_timeout() -> None:
    """worker1 stays frozen; worker0 (the leader, with a link to it) and worker2 shut down with
    a 2 s timeout. The retries added for broken links do not stretch it: each fails within
    the timeout (+ slack), naming worker1 (a reconnect to it that failed) or the timeout. A
    member only suspected is waited for, as one slow to arrive is (failure-semantics.md,
    "Shutdown")."""
    options = world_options(heartbeat_interval=0.1, peer_timeout=0.5, rpc_timeout=0)
    with open_world(3, options=options, faults=[], timeout=20) as world:
        assert world.faults is not None
        world.run(lambda r: rpc.rpc_sync(f"worker{(r + 1) % 3}", min, (1, 2)))
        world.faults.freeze(1)
        outcome: dict[int, str] = {}
        started = time.monotonic()
        took: dict[int, float] = {}

        def member(rank: int) -> None:
            try:
                world.leave(rank, timeout=2.0)
                outcome[rank] = "ok"
            except Exception as exc:
                outcome[rank] = repr(exc)
            took[rank] = time.monotonic() - started

        try:
            world.run(member, ranks=[0, 2], timeout=15)
        finally:
            world.faults.thaw(1)
            world.kill(1)
        for rank in (0, 2):
            assert ("PeerFailureError" in outcome[rank] and "worker1" in outcome[rank]) or (
                "RpcTimeoutError" in outcome[rank]
            ), outcome
            assert took[rank] < 2.0 + 1.0, took


def test_a_part_sent_again_for_a_finished_round_is_answered_with_its_result() -> None:
    """The leader keeps the last shutdown rounds it finished: a follower's part sent again
    (its link broke after the round ended) is answered with the result; a result sent again
    to a follower that has left the round creates no state there. A user's ``_all_gather``
    leaves nothing behind on the leader."""
    with open_world(2, timeout=20) as world:

        def survivors_round(rank: int) -> dict[str, object]:
            return _collectives.all_gather_survivors(rank * 10)

        first = world.run(survivors_round)
        assert first == [{"worker0": 0, "worker1": 10}] * 2
        leader = _collectives._groups(world.agents[0])
        (key,) = leader.done
        again = world.run_on(
            1,
            rpc.rpc_sync,
            "worker0",
            _collectives._gather_to_leader,
            (key, "worker1", 99, ["worker0", "worker1"]),
        )
        assert again == {"worker0": 0, "worker1": 10}  # the result, not a new round
        assert leader.states == {}
        world.run_on(
            0,
            rpc.rpc_sync,
            "worker1",
            _collectives._broadcast_to_followers,
            (key, {"worker0": -1}),
        )
        assert _collectives._groups(world.agents[1]).states == {}
        world.run(rpc.api._all_gather)
        assert list(leader.done) == [key] and leader.states == {}
