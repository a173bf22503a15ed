"""Pure parts of distgrad.profiler: keys, clock offsets, the trace builder."""

from __future__ import annotations

import torch

import distgrad.profiler as dprof
from distgrad._profiler._clock import ClockOffsets
from distgrad._profiler._keys import func_name
from distgrad._profiler._records import CallRecord, Event
from distgrad._profiler._trace import build_trace


def a_udf() -> None:
    """A module-level function."""


def test_keys_match_the_reference() -> None:
    """Keys are rpc_{mode}#{name}({self} -> {dst}); builtins use their aten name."""
    key = dprof._build_rpc_profiling_key(dprof.RPCExecMode.SYNC, "aten::add", "w0", "w1")
    assert key == "rpc_sync#aten::add(w0 -> w1)"
    assert dprof.build_rpc_profiling_key("remote", "f", "a", "b") == "rpc_remote#f(a -> b)"
    assert func_name(torch.add) == "aten::add"
    assert func_name(a_udf) == "a_udf"


def test_clock_offset_ntp_estimate() -> None:
    """A callee 5 ms ahead with symmetric 1 ms delays is estimated exactly."""
    clock = ClockOffsets()
    ms = 1_000_000
    offset = clock.observe(1, t0=0, t1=6 * ms, t2=7 * ms, t3=3 * ms)
    assert offset == 5 * ms
    assert clock.snapshot() == {1: (5 * ms, 2 * ms)}


def test_clock_offset_keeps_the_shortest_round_trip_but_contains_each_call() -> None:
    """The best (shortest round trip) sample wins; a call it would misplace uses its own."""
    clock = ClockOffsets()
    ms = 1_000_000
    clock.observe(1, 0, 1 * ms, 2 * ms, 3 * ms)  # rtt 2 ms, offset 0
    # asymmetric slow call: its own sample says 10 ms, the best estimate stays 0
    used = clock.observe(1, 100 * ms, 130 * ms, 131 * ms, 111 * ms)
    assert clock.offset(1) == 0
    assert 100 * ms <= 130 * ms - used and 131 * ms - used <= 111 * ms


def test_trace_builder_pairs_flows() -> None:
    """Each call gives a slice per side and two flow arrows with matching ids."""
    call = CallRecord("rpc_sync#f(w0 -> w1)", 0, 1, "w0", "w1", 7, 0, 10_000, 3, 2_000, 8_000)
    event = Event("rpc_sync#f(w0 -> w1)#remote_op: aten::add", "aten::add", 1, 3, 3_000, 4_000)
    trace = build_trace(0, 0, [], [event], [call], {0: "w0", 1: "w1"}, {})
    events = trace["traceEvents"]
    assert {e["args"]["name"] for e in events if e["name"] == "process_name"} == {"w0", "w1"}
    flows = sorted((e["id"], e["ph"], e["pid"]) for e in events if e["ph"] in "sf")
    assert flows == [(1, "f", 1), (1, "s", 0), (2, "f", 0), (2, "s", 1)]
    add = next(e for e in events if e["name"] == "aten::add")
    assert (add["pid"], add["ts"], add["dur"]) == (1, 3.0, 1.0)
