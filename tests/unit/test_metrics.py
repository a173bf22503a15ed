"""Unit tests of the always-on metrics (issue 30 item 1) on an in-memory world: per peer and
function, how calls ended and how long they took; in flight; verdicts on peers; membership;
the layers' figures (RRefs, distributed autograd)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import distgrad.autograd as dist_autograd
import distgrad.rpc as rpc
from distgrad._errors import PeerFailureError, RpcTimeoutError
from distgrad._rpc._core._statistics import (
    LATENCY_BOUNDS,
    FunctionStatistics,
    StatisticsRecorder,
    function_label,
)
from distgrad._testing._world import open_world

_release = threading.Event()


def double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def fail() -> None:
    raise ValueError("no")


def wait_release() -> int:
    _release.wait(10)
    return 1


def nap(seconds: float) -> None:
    time.sleep(seconds)


def make(x: torch.Tensor) -> torch.Tensor:
    return x + 1


def test_recorder_counts_outcomes_and_buckets_without_growing() -> None:
    """A recorder's entries: outcomes per function, buckets by latency (a call of exactly a
    bound falls in that bound's bucket; longer than every bound: the last one); the function
    names per peer are bounded."""
    rec = StatisticsRecorder()
    rec.sent(1, 10)
    rec.answered(1, 5, "f", LATENCY_BOUNDS[3], 0)
    rec.sent(1, 10)
    rec.answered(1, 0, "f", 100.0, 1)
    stats = rec.peers({1: "w1"})["w1"]
    f = stats.functions["f"]
    assert f.outcomes == {"ok": 1, "timeout": 1, "remote": 0, "peer_failure": 0, "other": 0}
    assert f.buckets[3] == 1 and f.buckets[-1] == 1 and sum(f.buckets) == 2
    assert f.calls == 2 and f.errors == 1 and f.seconds == pytest.approx(100.0 + 2e-4)
    assert stats.calls_in_flight == 0 and (stats.bytes_sent, stats.bytes_received) == (20, 5)
    for i in range(300):
        rec.answered(2, 0, f"g{i}", 0.0)
    functions = rec.peers({})["2"].functions
    assert len(functions) == 257 and functions["(other)"].calls == 300 - 256


def test_quantile_is_the_upper_bound_of_its_bucket() -> None:
    buckets = [0] * (len(LATENCY_BOUNDS) + 1)
    buckets[2] = 99
    buckets[10] = 1
    f = FunctionStatistics(outcomes={"ok": 100}, buckets=tuple(buckets), seconds=1.0)
    assert f.quantile(0.5) == LATENCY_BOUNDS[2] and f.quantile(0.995) == LATENCY_BOUNDS[10]
    assert FunctionStatistics({}, tuple([0] * 21), 0.0).quantile(0.5) == 0.0


def test_function_label_names_functions_and_callables() -> None:
    assert function_label(double) == f"{__name__}.double"
    assert function_label(torch.add) == "torch.add"

    class Unhashable:
        __hash__ = None  # type: ignore[assignment]

        def __call__(self) -> None: ...

    assert function_label(Unhashable()).endswith("<locals>.Unhashable")


def test_calls_counted_per_function_by_outcome() -> None:
    """ok, remote (the callee raised), timeout and peer failure, each under its function,
    with every call in a latency bucket and nothing left in flight."""
    with open_world(3) as world:
        for _ in range(3):
            world.run_on(0, rpc.rpc_sync, "worker1", double, (torch.ones(4),))
        with pytest.raises(ValueError):
            world.run_on(0, rpc.rpc_sync, "worker1", fail)
        with pytest.raises(RpcTimeoutError):
            world.run_on(0, rpc.rpc_sync, "worker1", nap, (1.0,), None, 0.05)
        world.kill(2)
        with pytest.raises(PeerFailureError):
            world.run_on(0, rpc.rpc_sync, "worker2", double, (torch.ones(1),))
        stats = world.agents[0].agent_statistics()
    to1 = stats.peers["worker1"].functions
    assert to1[f"{__name__}.double"].outcomes["ok"] == 3
    assert to1[f"{__name__}.fail"].outcomes["remote"] == 1
    assert to1[f"{__name__}.nap"].outcomes["timeout"] == 1
    to2 = stats.peers.get("worker2")
    assert to2 is not None and to2.calls_failed >= 1
    assert sum(f.outcomes["peer_failure"] for f in to2.functions.values()) >= 1
    for peer in stats.peers.values():
        for f in peer.functions.values():
            assert sum(f.buckets) == f.calls
        assert peer.calls_in_flight == 0


def test_in_flight_per_peer_while_a_call_waits() -> None:
    _release.clear()
    with open_world(2) as world:
        future = world.run_on(0, rpc.rpc_async, "worker1", wait_release)
        deadline = time.monotonic() + 10
        while world.agents[1].agent_statistics().peers.get("worker0") is None:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        caller = world.agents[0].agent_statistics().peers["worker1"]
        callee = world.agents[1].agent_statistics().peers["worker0"]
        assert caller.calls_in_flight == 1 and callee.requests_in_flight == 1
        _release.set()
        assert future.wait() == 1
        caller = world.agents[0].agent_statistics().peers["worker1"]
    assert caller.calls_in_flight == 0


def test_verdicts_on_peers_and_membership_are_counted() -> None:
    """A severed link: each side holds the other dead, cause ``severed``; a dynamic group's
    joins and leaves are counted."""
    with open_world(2) as world:
        world.agents[0].transport.sever(1)
        events = world.agents[0].agent_statistics().transport
        assert events is not None and (1, "dead", "severed", 1) in events.peer_events
    with open_world(2, dynamic=True) as world:
        world.join()
        world.leave(2)
        membership = world.agents[0].agent_statistics().membership
    assert membership.get("joined", 0) >= 1 and membership.get("left", 0) == 1


def test_layer_figures_rrefs_and_backward_passes() -> None:
    """RRefs owned on the owner; a backward pass driven by worker0 is counted there, with the
    gradient bytes the callee sent back."""
    kept: list[object] = []
    with open_world(2) as world:

        def job() -> None:
            rref = rpc.remote("worker1", make, (torch.ones(3),))
            rref.to_here()
            kept.append(rref)  # (alive: its owner keeps it)
            x = torch.ones(256, requires_grad=True)
            with dist_autograd.context() as cid:
                y = rpc.rpc_sync("worker1", double, (x,))
                dist_autograd.backward(cid, [y.sum()])

        before = world.agents[0].agent_statistics().layers  # (the process's earlier passes)
        sent_before = world.agents[1].agent_statistics().layers["gradient_bytes_sent_total"]
        world.run_on(0, job)
        owner = world.agents[1].agent_statistics().layers
        driver = world.agents[0].agent_statistics().layers
        callee = world.agents[1].agent_statistics().layers
        kept.clear()
    assert owner["rrefs_owned"] >= 1
    assert driver["backward_passes_total"] - before["backward_passes_total"] == 1
    assert driver["backward_passes_failed_total"] == before["backward_passes_failed_total"]
    assert driver["backward_seconds_total"] > before["backward_seconds_total"]
    assert callee["gradient_bytes_sent_total"] - sent_before >= 256 * 4
