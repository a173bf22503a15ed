"""Profiling across workers (``distgrad.profiler``), end to end.

One run of three real workers drives every scenario from worker0 (the others only serve) and
returns plain data; the tests below check it.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

import distgrad.rpc as rpc
from tests._harness import run_workers

pytestmark = pytest.mark.timeout(120)

Names = list[tuple[str, int, bool]]


def udf_with_block(x: torch.Tensor) -> torch.Tensor:
    """A Python UDF with a ``record_function`` block in it."""
    with torch.autograd.profiler.record_function("##forward##"):
        return torch.add(x, 1)


def slow_add(x: torch.Tensor) -> torch.Tensor:
    time.sleep(0.05)
    return torch.add(x, 1)


def nested_add(x: torch.Tensor) -> torch.Tensor:
    """Calls worker2 from worker1 (profiled when its caller is)."""
    return rpc.rpc_async("worker2", slow_add, (x,)).wait()  # type: ignore[no-any-return]


def profiled_here() -> bool:
    """Is a profiler on in the thread that serves this request?"""
    return bool(torch.autograd._profiler_enabled())  # type: ignore[attr-defined]


def stage(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A model stage held by worker1."""
    return torch.tanh(x @ w)


def echo(x: torch.Tensor) -> torch.Tensor:
    return x


def _own_ops(rank: int) -> dict[str, list[str]]:
    """The local ``aten::`` events of calls that only send and receive tensors (plain, requiring
    grad, a transposed view; sync, async, inside a distributed autograd context), under the
    legacy and the Kineto profiler: the program itself runs no operator there."""
    import distgrad.autograd as dist_autograd

    xs = (torch.randn(3, 3), torch.randn(3, 3, requires_grad=True), torch.randn(4, 3).t())
    found: dict[str, list[str]] = {}
    profilers = {
        "legacy": torch.autograd.profiler.profile,
        "kineto": lambda: torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]),
    }
    for name, make in profilers.items():
        with make() as prof:
            for t in xs:
                rpc.rpc_sync("worker1", echo, (t,))
            rpc.rpc_async("worker2", echo, (xs[0],)).wait()
            with dist_autograd.context():
                rpc.rpc_sync("worker1", echo, (xs[1],))
        events = prof.function_events if name == "legacy" else prof.events()
        found[name] = sorted(
            {n for n, _, remote in _names(events) if not remote and n.startswith("aten::")}
        )
    return found


def _names(events: Any) -> Names:
    return [(e.name, int(e.node_id), bool(e.is_remote)) for e in events]


def _rpc_names(events: Any) -> Names:
    return [n for n in _names(events) if n[0].startswith("rpc_")]


def _scenarios(rank: int, world_size: int, trace_path: str) -> dict[str, Any]:
    import distgrad.autograd as dist_autograd
    import distgrad.profiler as dprof
    from distgrad._rpc._core import _profiling
    from distgrad._rpc._core._agent import current_agent

    if rank != 0:
        return {}
    out: dict[str, Any] = {}
    x = torch.ones(2, 2)

    # no profiler: the request is plain, the callee does not profile
    out["plain_callee_profiled"] = rpc.rpc_sync("worker1", profiled_here)

    with torch.autograd.profiler.profile() as prof:
        rpc.rpc_sync("worker1", torch.add, (x, 1))
        rpc.rpc_sync("worker1", udf_with_block, (x,))
        fut = rpc.rpc_async("worker1", slow_add, (x,))
        fut.wait()
        rpc.rpc_sync("worker1", nested_add, (x,))
        out["profiled_callee_profiled"] = rpc.rpc_sync("worker1", profiled_here)
        agent = current_agent()
        assert agent is not None
        me, dst = agent.worker_info, agent.get_worker_info("worker1")
        with _profiling.key_scope("remote", slow_add, me, dst) as scope:
            created = agent.call_async(dst, slow_add, (x,), {})
            scope.end_on(created)
        created.wait()
    with torch.autograd.profiler.profile() as remote_prof:
        rref = rpc.remote("worker1", slow_add, (x,))
        rref.to_here()
        rref._get_future().wait()  # the creation answered (as the reference's profiling future)
    out["remote"] = _names(remote_prof.function_events)
    out["autograd"] = _names(prof.function_events)
    out["async_us"] = [
        e.cpu_time_total
        for e in prof.function_events
        if e.name == "rpc_async#slow_add(worker0 -> worker1)"
    ]

    with torch.autograd.profiler_legacy.profile() as legacy:
        rpc.rpc_sync("worker1", torch.add, (x, 1))
        rpc.rpc_async("worker1", udf_with_block, (x,)).wait()
    out["legacy"] = _names(legacy.function_events)

    # a distributed backward under the legacy profiler (SPEC 2.9)
    with torch.autograd.profiler_legacy.profile() as legacy_backward, dist_autograd.context() as c:
        t = torch.ones(2, requires_grad=True)
        dist_autograd.backward(c, [rpc.rpc_sync("worker1", torch.add, (t, t)).sum()])
    events = legacy_backward.function_events
    total = {e.name: e.cpu_time_total for e in events if e.node_id in (-1, 0)}
    out["backward_events"] = [(e.name, e.node_id) for e in events if "Backward" in e.name]
    out["backward_times"] = total

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as kineto:
        rpc.rpc_sync("worker1", torch.add, (x, 1))
        rpc.rpc_async("worker2", udf_with_block, (x,)).wait()
    out["kineto"] = _names(kineto.events())
    out["kineto_averages"] = [(a.key, a.node_id, a.count) for a in kineto.key_averages()]

    with torch.autograd.profiler.profile() as idle:
        torch.add(x, 1)
    out["idle"] = _names(idle.function_events)

    # a training step: forward over RPC, distributed backward, one trace
    w = torch.randn(2, 2, requires_grad=True)
    with dprof.profile() as step, dist_autograd.context() as ctx:
        y = rpc.rpc_sync("worker1", stage, (x.requires_grad_(), w))
        loss = rpc.rpc_sync("worker2", torch.sum, (y * 2,))
        dist_autograd.backward(ctx, [loss])
        out["grads"] = len(dist_autograd.get_gradients(ctx))
    out["own_ops"] = _own_ops(rank)
    step.export_chrome_trace(trace_path)
    out["step"] = _names(step.events())
    out["offsets"] = dprof.clock_offsets()
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    trace = tmp_path_factory.mktemp("trace") / "step.json"
    out: dict[str, Any] = run_workers(_scenarios, 3, timeout=90, kwargs={"trace_path": str(trace)})[
        0
    ]
    out["trace"] = json.loads(Path(trace).read_text())
    return out


K_ADD = "rpc_sync#aten::add(worker0 -> worker1)"


def test_distributed_backward_events_as_torch(results: dict[str, Any]) -> None:
    """A distributed backward under the legacy profiler records torch's names: the
    ``torch::distributed::autograd::backward`` range and one send and one recv function event
    on the caller, each shorter than the range; the callee's send/recv events come back as
    remote events of the gradient message."""
    events = results["backward_events"]
    local = [name for name, node in events if node in (-1, 0) and "#" not in name]
    send = "torch::distributed::autograd::SendRpcBackward"
    recv = "torch::distributed::autograd::RecvRpcBackward"
    assert local.count(send) == 1 and local.count(recv) == 1
    times = results["backward_times"]
    assert times[send] < times["torch::distributed::autograd::backward"]
    assert times[recv] < times["torch::distributed::autograd::backward"]
    remote = [name for name, node in events if node == 1]
    assert any(name.endswith("#remote_op: " + send) for name in remote)
    assert any(name.endswith("#remote_op: " + recv) for name in remote)


def test_rpc_sync_builtin_event_names(results: dict[str, Any]) -> None:
    """rpc_sync(torch.add) records the reference's key on node 0 and remote ops on node 1."""
    names = results["autograd"]
    assert names.count((K_ADD, 0, False)) == 1
    assert (f"{K_ADD}#remote_op: aten::add", 1, True) in names
    assert all(node == 0 and not remote for name, node, remote in names if "#" not in name)


def test_python_udf_and_record_function_appear_remotely(results: dict[str, Any]) -> None:
    """A UDF is keyed by its qualname; its record_function block shows up as a remote op."""
    key = "rpc_sync#udf_with_block(worker0 -> worker1)"
    names = results["autograd"]
    assert (key, 0, False) in names
    assert (f"{key}#remote_op: ##forward##", 1, True) in names
    assert (f"{key}#remote_op: aten::add", 1, True) in names


def test_rpc_async_range_ends_when_future_completes(results: dict[str, Any]) -> None:
    """The rpc_async range covers the remote work (50 ms sleep) and has remote events."""
    key = "rpc_async#slow_add(worker0 -> worker1)"
    assert (f"{key}#remote_op: aten::add", 1, True) in results["autograd"]
    assert len(results["async_us"]) == 1 and results["async_us"][0] >= 50_000


def test_nested_call_nests_keys(results: dict[str, Any]) -> None:
    """A call made by the callee nests its key; its events carry the node that ran them."""
    outer = "rpc_sync#nested_add(worker0 -> worker1)"
    inner = "rpc_async#slow_add(worker1 -> worker2)"
    names = results["autograd"]
    assert (f"{outer}#remote_op: {inner}", 1, True) in names
    assert (f"{outer}#remote_op: {inner}#remote_op: aten::add", 2, True) in names


def test_key_scope_names_the_call(results: dict[str, Any]) -> None:
    """Inside key_scope("remote"), the call is recorded as rpc_remote#..., not rpc_async#."""
    key = "rpc_remote#slow_add(worker0 -> worker1)"
    names = results["autograd"]
    assert (key, 0, False) in names
    assert (f"{key}#remote_op: aten::add", 1, True) in names
    assert names.count(("rpc_async#slow_add(worker0 -> worker1)", 0, False)) == 1  # the other


def test_rpc_remote_is_keyed_rpc_remote(results: dict[str, Any]) -> None:
    """rpc.remote records rpc_remote#{func} with the callee's ops under it."""
    key = "rpc_remote#slow_add(worker0 -> worker1)"
    names = results["remote"]
    assert names.count((key, 0, False)) == 1
    assert (f"{key}#remote_op: aten::add", 1, True) in names


def test_legacy_profiler_gets_remote_events(results: dict[str, Any]) -> None:
    """torch.autograd.profiler_legacy.profile sees rpc ranges (sync and async) and remote ops."""
    names = results["legacy"]
    assert (K_ADD, 0, False) in names
    assert (f"{K_ADD}#remote_op: aten::add", 1, True) in names
    key = "rpc_async#udf_with_block(worker0 -> worker1)"
    assert (key, 0, False) in names  # its range ended on another thread: rebuilt
    assert (f"{key}#remote_op: ##forward##", 1, True) in names


def test_kineto_profiler_gets_remote_events(results: dict[str, Any]) -> None:
    """torch.profiler.profile (Kineto): events() and key_averages() include remote events."""
    names = results["kineto"]
    key = "rpc_async#udf_with_block(worker0 -> worker2)"
    assert (K_ADD, 0, False) in names
    assert (f"{key}#remote_op: ##forward##", 2, True) in names
    averages = {(k, n): c for k, n, c in results["kineto_averages"]}
    assert averages[(K_ADD, 0)] == 1
    assert averages[(f"{K_ADD}#remote_op: aten::add", 1)] == 1


def test_no_profiling_no_flag_no_events(results: dict[str, Any]) -> None:
    """Without a profiler the request is plain (the callee runs unprofiled); a profile with
    no calls has no rpc or remote events."""
    assert results["plain_callee_profiled"] is False
    assert results["profiled_callee_profiled"] is True
    assert not [n for n in results["idle"] if n[0].startswith("rpc_") or n[2]]


def test_trace_has_a_track_per_worker(results: dict[str, Any]) -> None:
    """The exported trace names one process track per worker."""
    events = results["trace"]["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {0: "worker0", 1: "worker1", 2: "worker2"}
    assert {e["pid"] for e in events if e["ph"] == "X"} == {0, 1, 2}


def test_trace_rpc_events_and_flows(results: dict[str, Any]) -> None:
    """Each RPC is a slice on both sides, joined by flow arrows there and back."""
    events = results["trace"]["traceEvents"]
    calls = [e for e in events if e.get("cat") == "rpc"]
    serves = [e for e in events if e.get("cat") == "rpc.serve"]
    assert any(e["name"] == "rpc_sync#stage(worker0 -> worker1)" and e["pid"] == 0 for e in calls)
    assert any(e["name"] == "rpc_sync#stage(worker0 -> worker1)" and e["pid"] == 1 for e in serves)
    assert len(calls) == len(serves)
    flows = [e for e in events if e["ph"] in ("s", "f")]
    by_id = Counter((e["id"], e["ph"]) for e in flows)
    ids = {e["id"] for e in flows}
    assert len(ids) == 2 * len(calls)
    assert all(by_id[(i, "s")] == 1 and by_id[(i, "f")] == 1 for i in ids)
    for call in calls:  # the callee's handling lies within the caller's range
        serve = next(s for s in serves if s["name"] == call["name"] and s["ts"] >= call["ts"])
        assert serve["ts"] + serve["dur"] <= call["ts"] + call["dur"] + 1


def test_trace_shows_the_distributed_backward(results: dict[str, Any]) -> None:
    """Gradient messages between workers are in the step's trace, in both directions."""
    events = results["trace"]["traceEvents"]
    grads = {
        (e["pid"], e["args"]["dst"])
        for e in events
        if e.get("cat") == "rpc" and "_grad_message" in e["name"]
    }
    assert (0, "worker1") in grads or (0, "worker2") in grads
    assert any(src != 0 for src, _dst in grads)  # sent by a callee, nested
    assert results["grads"] == 2
    ops = {e["name"] for e in events if e["ph"] == "X" and e["pid"] == 1}
    assert any("Backward" in name for name in ops)


def test_clock_offsets_are_estimated(results: dict[str, Any]) -> None:
    """Each peer gets an offset estimate; on one host it is within its round trip of zero."""
    offsets = results["offsets"]
    assert set(offsets) == {1, 2}
    for offset, rtt in offsets.values():
        assert abs(offset) <= rtt / 2 + 1_000_000


@pytest.mark.parametrize("profiler", ["legacy", "kineto"])
def test_distgrad_serialisation_stays_out_of_the_profile(
    results: dict[str, Any], profiler: str
) -> None:
    """Sending and receiving tensors records no operator in the caller's profile (no
    ``aten::detach``, ``aten::to``, ``aten::resolve_conj``, ``aten::resolve_neg`` per tensor
    pickled, no ``aten::lift_fresh`` per tensor unpickled), as with torch's RPC."""
    assert results["own_ops"][profiler] == []
