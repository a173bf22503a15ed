"""Reliable control notices (``_rpc/_rrefs/_outbox.py``) on in-memory worlds under injected faults:
every notice runs once on the receiver, in the order sent, and the sender's outbox ends empty --
whether the notice or its acknowledgement is dropped, duplicated, delayed or reordered."""

from __future__ import annotations

import threading
import time

import pytest

from distgrad._rpc._core._agent import current_agent
from distgrad._rpc._rrefs._outbox import outbox_of
from distgrad.testing import Fault, open_world, world_options

N = 8
OPTIONS = dict(rpc_timeout=2.0, heartbeat_interval=0.05, peer_timeout=2.0)
_RAN: dict[int, list[int]] = {}
_RAN_LOCK = threading.Lock()


def _record(value: int) -> None:
    """The notice under test: note ``value`` on the receiving worker."""
    agent = current_agent()
    assert agent is not None
    with _RAN_LOCK:
        _RAN.setdefault(agent.worker_info.id, []).append(value)


ACK = "RELIABLE_NOTICE_ACK"
FAULTS: dict[str, Fault | None] = {
    "none": None,
    "notice-dropped": Fault("drop", function="_record", nth=2),
    "notices-dropped": Fault("drop", function="_record", times=3),
    "notice-duplicated": Fault("duplicate", function="_record", nth=1),
    "notice-reordered": Fault("reorder", function="_record", nth=1, hold=0.1),
    "notice-delayed": Fault("delay", function="_record", nth=3, seconds=0.3),
    "ack-dropped": Fault("drop", type=ACK, times=2),
    "ack-duplicated": Fault("duplicate", type=ACK),
    "ack-reordered": Fault("reorder", type=ACK, nth=1, hold=0.1),
}


@pytest.mark.parametrize("name", sorted(FAULTS))
def test_notices_run_once_in_order_under_a_fault(name: str) -> None:
    """N notices from worker0 to worker1 run there exactly once each, in order, and the outbox
    empties, with one fault on the notices or their acknowledgements."""
    _RAN.clear()
    fault = FAULTS[name]
    faults = [] if fault is None else [fault]

    def body(rank: int) -> int:
        agent = current_agent()
        assert agent is not None
        if rank == 0:
            box = outbox_of(agent)
            for value in range(N):
                box.send(1, _record, (value,))
            deadline = time.monotonic() + 8.0
            while box.pending() and time.monotonic() < deadline:
                time.sleep(0.02)
            return box.pending()
        deadline = time.monotonic() + 8.0
        while len(_RAN.get(1, [])) < N and time.monotonic() < deadline:
            time.sleep(0.02)
        return 0

    with open_world(2, options=world_options(**OPTIONS), faults=faults, timeout=15) as world:
        pending = world.run(body)[0]
        if fault is not None:
            assert world.faults is not None and world.faults.fired(), "the fault never fired"
    assert _RAN.get(1) == list(range(N)), _RAN.get(1)
    assert pending == 0, f"{pending} notices never acknowledged"


def test_notices_to_a_frozen_worker_run_after_it_thaws() -> None:
    """A worker frozen between the send and the acknowledgement (shorter than peer_timeout)
    runs every notice once, in order, once it thaws; the outbox empties."""
    _RAN.clear()

    def body(rank: int) -> int:
        agent = current_agent()
        assert agent is not None
        if rank != 0:
            return 0
        box = outbox_of(agent)
        box.send(1, _record, (0,))
        world.faults.freeze(1)  # type: ignore[union-attr]
        for value in range(1, N):
            box.send(1, _record, (value,))
        time.sleep(0.5)  # several resend periods while frozen
        world.faults.thaw(1)  # type: ignore[union-attr]
        deadline = time.monotonic() + 8.0
        while box.pending() and time.monotonic() < deadline:
            time.sleep(0.02)
        return box.pending()

    never = Fault("delay", function="no-such-function")
    with open_world(2, options=world_options(**OPTIONS), faults=[never], timeout=15) as world:
        pending = world.run(body)[0]
    assert _RAN.get(1) == list(range(N)), _RAN.get(1)
    assert pending == 0


def _send_and_settle(world: object, src: int, dst: int, values: range) -> int:
    """On ``src``: send ``values`` to ``dst`` as notices; wait until acknowledged (8 s at most);
    return what is still pending."""

    def body() -> int:
        agent = current_agent()
        assert agent is not None
        box = outbox_of(agent)
        for value in values:
            box.send(dst, _record, (value,))
        deadline = time.monotonic() + 8.0
        while box.pending() and time.monotonic() < deadline:
            time.sleep(0.02)
        return box.pending()

    return world.run_on(src, body)  # type: ignore[attr-defined, no-any-return]


def _ran_on(rank: int, count: int) -> list[int]:
    deadline = time.monotonic() + 8.0
    while len(_RAN.get(rank, [])) < count and time.monotonic() < deadline:
        time.sleep(0.02)
    return list(_RAN.get(rank, []))


def test_a_relaunched_receiver_runs_the_notices_meant_for_it() -> None:
    """worker1 restarts (a new incarnation) after running notices 1-3 of worker0: worker0's
    next notices are numbered afresh for it and run there once, in order (they waited for
    numbers the new incarnation never saw, for ever)."""
    _RAN.clear()
    with open_world(2, options=world_options(**OPTIONS), dynamic=True) as world:
        assert _send_and_settle(world, 0, 1, range(3)) == 0
        assert _ran_on(1, 3) == [0, 1, 2]
        world.kill(1)
        world.join(1)
        _RAN.pop(1)
        assert _send_and_settle(world, 0, 1, range(3, 6)) == 0
        assert _ran_on(1, 3) == [3, 4, 5]


def test_a_relaunched_sender_is_counted_afresh() -> None:
    """worker1 sends notices 1-3 to worker0, restarts, and sends again from number 1: the new
    incarnation's notices run on worker0 (they were dropped as duplicates of the old ones and
    acknowledged: lost without a trace)."""
    _RAN.clear()
    with open_world(2, options=world_options(**OPTIONS), dynamic=True) as world:
        assert _send_and_settle(world, 1, 0, range(3)) == 0
        assert _ran_on(0, 3) == [0, 1, 2]
        world.kill(1)
        world.join(1)
        assert _send_and_settle(world, 1, 0, range(3, 6)) == 0
        assert _ran_on(0, 6) == [0, 1, 2, 3, 4, 5]


def test_nothing_queued_for_an_old_incarnation_reaches_the_new_one() -> None:
    """Notices queued for worker1 while it is frozen (never acknowledged) are dropped when it
    is replaced by a new incarnation: the new one runs only what was sent after."""
    _RAN.clear()
    never = Fault("delay", function="no-such-function")
    with open_world(
        2, options=world_options(**OPTIONS), faults=[never], dynamic=True, timeout=20
    ) as world:
        assert world.faults is not None
        world.faults.freeze(1)

        def queue() -> int:
            agent = current_agent()
            assert agent is not None
            for value in range(3):
                outbox_of(agent).send(1, _record, (value,))
            return outbox_of(agent).pending()

        assert world.run_on(0, queue) == 3
        world.kill(1)  # (the new incarnation's transport is not frozen)
        world.join(1)
        assert _send_and_settle(world, 0, 1, range(3, 5)) == 0
        time.sleep(0.3)  # several resend periods: an old notice would have arrived by now
        assert _RAN.get(1) == [3, 4], _RAN.get(1)
