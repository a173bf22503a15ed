"""One Chrome/Perfetto trace across workers (the JSON "Trace Event Format").

Each worker is a process track: ``pid`` = its rank, named by a ``process_name`` metadata
event. Slices (``"ph": "X"``) are the caller's local events, the events remote workers
recorded for its calls (on their own tracks, times mapped to the caller's clock), and, for
every profiled call -- nested ones included -- the caller's range and the callee's handling
of it. Flow events draw an arrow from each call to its handling (``"s"`` -> ``"f"``) and one
back from the handling to the end of the call. Times are microseconds from the start of the
caller's profile.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from ._records import CallRecord, Event

__all__ = ["build_trace", "write_trace"]

_EPS_US = 0.001  # flow ends are put this far inside their slice, so they bind to it


def _resolve_threads(
    calls: list[CallRecord], local: list[Any], rank: int, base_ns: int
) -> list[int]:
    """The caller thread of each call made here: the thread of the local range of the same
    name that started nearest to it (the range and the record are the same call)."""
    by_name: dict[str, list[Any]] = defaultdict(list)
    for fe in local:
        by_name[fe.name].append(fe)
    threads = Counter(fe.thread for fe in local)
    fallback = threads.most_common(1)[0][0] if threads else 0
    out = []
    for call in calls:
        if call.thread != -1 or call.src != rank:
            out.append(call.thread if call.thread != -1 else fallback)
            continue
        start_us = (call.start_ns - base_ns) / 1000
        candidates = by_name.get(call.key)
        if not candidates:
            out.append(fallback)
            continue
        best = min(candidates, key=lambda fe: abs(fe.time_range.start - start_us))
        candidates.remove(best)
        out.append(int(best.thread))
    return out


def _slice(name: str, cat: str, pid: int, tid: int, ts: float, dur: float, **args: Any) -> Any:
    return {
        "name": name,
        "cat": cat,
        "ph": "X",
        "pid": pid,
        "tid": tid,
        "ts": ts,
        "dur": max(dur, 0.0),
        "args": args,
    }


def _flow(ph: str, ident: int, pid: int, tid: int, ts: float) -> Any:
    event: dict[str, Any] = {
        "name": "rpc",
        "cat": "rpc.flow",
        "ph": ph,
        "id": ident,
        "pid": pid,
        "tid": tid,
        "ts": ts,
    }
    if ph == "f":
        event["bp"] = "e"
    return event


def build_trace(
    rank: int,
    base_ns: int,
    local: list[Any],
    remote: list[Event],
    calls: list[CallRecord],
    names: dict[int, str],
    offsets: dict[int, tuple[int, int]],
) -> dict[str, Any]:
    """The trace as a JSON-ready dict (see the module docstring)."""
    keys_by_node: dict[int, set[str]] = defaultdict(set)
    for call in calls:
        keys_by_node[call.src].add(call.key)
    local = [fe for fe in local if not fe.is_remote]
    events: list[Any] = []
    for fe in local:
        if fe.name in keys_by_node[rank]:
            continue  # drawn from the call's record below
        events.append(
            _slice(
                fe.name,
                "cpu_op",
                rank,
                int(fe.thread),
                float(fe.time_range.start),
                float(fe.time_range.end - fe.time_range.start),
            )
        )
    for event in remote:
        if event.op in keys_by_node[event.node]:
            continue
        events.append(
            _slice(
                event.op,
                "cpu_op",
                event.node,
                event.thread,
                (event.start_ns - base_ns) / 1000,
                (event.end_ns - event.start_ns) / 1000,
                remote_name=event.name,
            )
        )
    threads = _resolve_threads(calls, local, rank, base_ns)
    for index, (call, thread) in enumerate(zip(calls, threads, strict=True)):
        start = (call.start_ns - base_ns) / 1000
        end = (call.end_ns - base_ns) / 1000
        serve_start = (call.serve_start_ns - base_ns) / 1000
        serve_end = (call.serve_end_ns - base_ns) / 1000
        events.append(
            _slice(call.key, "rpc", call.src, thread, start, end - start, dst=call.dst_name)
        )
        events.append(
            _slice(
                call.key,
                "rpc.serve",
                call.dst,
                call.serve_thread,
                serve_start,
                serve_end - serve_start,
                src=call.src_name,
            )
        )
        out_id, back_id = 2 * index + 1, 2 * index + 2
        events.append(_flow("s", out_id, call.src, thread, start))
        events.append(_flow("f", out_id, call.dst, call.serve_thread, serve_start))
        back = max(serve_start, serve_end - _EPS_US)
        events.append(_flow("s", back_id, call.dst, call.serve_thread, back))
        events.append(_flow("f", back_id, call.src, thread, max(start, end - _EPS_US)))
    nodes = {rank} | {e.node for e in remote} | {c.src for c in calls} | {c.dst for c in calls}
    meta: list[Any] = []
    for node in sorted(nodes):
        name = names.get(node, f"worker{node}")
        meta.append(
            {"name": "process_name", "ph": "M", "pid": node, "tid": 0, "args": {"name": name}}
        )
        meta.append(
            {
                "name": "process_sort_index",
                "ph": "M",
                "pid": node,
                "tid": 0,
                "args": {"sort_index": node},
            }
        )
    return {
        "traceEvents": meta + events,
        "displayTimeUnit": "ms",
        "otherData": {
            "distgrad": {
                "rank": rank,
                "base_time_ns": base_ns,
                "clock_offsets_ns": {
                    str(peer): {"offset": off, "round_trip": rtt}
                    for peer, (off, rtt) in sorted(offsets.items())
                },
            }
        },
    }


def write_trace(path: str | Path, trace: dict[str, Any]) -> None:
    Path(path).write_text(json.dumps(trace))
