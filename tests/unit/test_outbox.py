"""Reliable control notices (``_rpc/_outbox.py``) on in-memory worlds under injected faults:
every notice runs once on the receiver, in the order sent, and the sender's outbox ends empty --
whether the notice or its acknowledgement is dropped, duplicated, delayed or reordered."""

from __future__ import annotations

import threading
import time

import pytest

from distgrad._rpc._agent import current_agent
from distgrad._rpc._outbox import outbox_of
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
