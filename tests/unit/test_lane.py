"""The serial lane (``_rpc._core._lane``): tasks run in order on one thread, ``busy`` until
the last one has finished, a failing task does not stop the lane, and ``stop`` runs what was
given, ends the thread and refuses more."""

from __future__ import annotations

import threading

import pytest

from distgrad._rpc._core._lane import SerialLane


def test_tasks_run_in_order_on_one_thread_and_busy_covers_them() -> None:
    lane = SerialLane("test-lane")
    gate = threading.Event()
    ran: list[tuple[int, str]] = []
    assert not lane.busy()
    lane.submit(gate.wait)
    for i in range(50):
        lane.submit(lambda i=i: ran.append((i, threading.current_thread().name)))
    lane.submit(lambda: 1 / 0)  # logged, and the lane goes on
    lane.submit(lambda: ran.append((50, threading.current_thread().name)))
    assert lane.busy()  # held by the gate
    gate.set()
    lane.stop()
    assert [i for i, _ in ran] == list(range(51))
    assert {name for _, name in ran} == {"test-lane"}
    assert not lane.busy()
    assert not any(t.name == "test-lane" for t in threading.enumerate())
    with pytest.raises(RuntimeError, match="stopped"):
        lane.submit(print)
    lane.stop()  # idempotent


def test_a_lane_never_used_starts_no_thread() -> None:
    lane = SerialLane("idle-lane")
    lane.stop()
    assert not any(t.name == "idle-lane" for t in threading.enumerate())
