"""What a member shows of itself (issue 30): its figures as one JSON-able snapshot (what
``distgrad top`` reads) and as Prometheus' text exposition format (version 0.0.4). Metric
names and labels: docs/observability.md."""

from __future__ import annotations

import os
import resource
import sys
import time
from collections.abc import Iterator
from typing import Any

from .._rpc._core import LATENCY_BOUNDS, OUTCOMES, AgentStatistics, RpcAgent

__all__ = ["CONTENT_TYPE", "prometheus_text", "snapshot"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _memory() -> dict[str, float]:
    """This process's resident memory now and at its peak (bytes), and its CPU seconds."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    peak = usage.ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    resident = 0
    try:
        with open("/proc/self/statm", "rb") as f:
            resident = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        resident = peak
    return {
        "resident_bytes": resident,
        "peak_resident_bytes": peak,
        "cpu_seconds": usage.ru_utime + usage.ru_stime,
    }


def snapshot(agent: RpcAgent) -> dict[str, Any]:
    """Everything this member shows, as plain data (JSON-able)."""
    stats: AgentStatistics = agent.agent_statistics()
    transport = stats.transport
    names = {info.id: info.name for info in agent.get_worker_infos()}
    suspected: list[str] = []
    dead: list[str] = []
    live = agent._transport
    if live is not None:
        for rank, name in names.items():
            if rank == agent.worker_info.id:
                continue
            if live.is_dead(rank):
                dead.append(name)
            elif live.is_suspected(rank):
                suspected.append(name)
    peers: dict[str, Any] = {}
    for name, peer in stats.peers.items():
        peers[name] = {
            "calls_sent": peer.calls_sent,
            "calls_failed": peer.calls_failed,
            "calls_resent": peer.calls_resent,
            "calls_in_flight": peer.calls_in_flight,
            "requests_served": peer.requests_served,
            "requests_failed": peer.requests_failed,
            "requests_refused": peer.requests_refused,
            "requests_in_flight": peer.requests_in_flight,
            "bytes_sent": peer.bytes_sent,
            "bytes_received": peer.bytes_received,
            "functions": {
                function: {
                    "outcomes": dict(f.outcomes),
                    "buckets": list(f.buckets),
                    "seconds": f.seconds,
                }
                for function, f in peer.functions.items()
            },
        }
    events = [
        {"peer": names.get(rank, str(rank)), "kind": kind, "cause": cause, "count": count}
        for rank, kind, cause, count in (transport.peer_events if transport else ())
    ]
    pool = agent.get_metrics()
    return {
        "worker": stats.worker_name,
        "rank": agent.worker_info.id,
        "incarnation": f"{agent.incarnation:016x}",
        "state": stats.state.value,
        "time": time.time(),
        "uptime": stats.uptime,
        "calls_in_flight": stats.calls_in_flight,
        "requests_in_flight": stats.requests_in_flight,
        "worker_threads": int(pool["agent.thread_pool_size"]),
        "worker_threads_idle": int(pool["agent.num_idle_threads"]),
        "members": sorted(names.values()),
        "suspected": suspected,
        "dead": dead,
        "peers": peers,
        "peer_events": events,
        "membership": dict(stats.membership),
        "transport": {
            "open_connections": transport.open_connections if transport else 0,
            "connections_opened": transport.connections_opened if transport else 0,
            "connections_accepted": transport.connections_accepted if transport else 0,
            "handshakes_failed": transport.handshakes_failed if transport else 0,
            "protocol_errors": transport.protocol_errors if transport else 0,
            "stalls": transport.stalls if transport else 0,
            "bytes_through_ring": transport.bytes_through_ring if transport else 0,
            "bytes_read_directly": transport.bytes_read_directly if transport else 0,
            "ring_bytes_lent": transport.ring_bytes_lent if transport else 0,
        },
        "layers": dict(stats.layers),
        "process": _memory(),
        "latency_bounds": list(LATENCY_BOUNDS),
    }


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(**labels: str) -> str:
    return "{" + ",".join(f'{k}="{_escape(str(v))}"' for k, v in labels.items()) + "}"


def _number(value: float) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int):
        return str(value)
    return repr(float(value))


class _Families:
    """Samples grouped by metric family (the format wants a family's samples together)."""

    def __init__(self) -> None:
        self._families: dict[str, tuple[str, str, list[str]]] = {}

    def add(self, name: str, kind: str, help_: str, labels: str, value: float) -> None:
        if kind == "counter" and name.endswith("_total"):
            name = name[: -len("_total")]
        family = self._families.get(name)
        if family is None:
            family = self._families[name] = (kind, help_, [])
        sample = name + "_total" if kind == "counter" else name
        family[2].append(f"{sample}{labels} {_number(value)}")

    def add_line(self, name: str, kind: str, help_: str, line: str) -> None:
        family = self._families.get(name)
        if family is None:
            family = self._families[name] = (kind, help_, [])
        family[2].append(line)

    def lines(self) -> Iterator[str]:
        for name, (kind, help_, samples) in self._families.items():
            yield f"# HELP {name} {help_}"
            yield f"# TYPE {name} {kind}"
            yield from samples


def prometheus_text(snap: dict[str, Any]) -> str:
    """The snapshot in Prometheus' text format (0.0.4)."""
    w = snap["worker"]
    out = _Families()
    me = _labels(worker=w)
    out.add("distgrad_up", "gauge", "1 while the member answers", me, 1)
    out.add(
        "distgrad_uptime_seconds", "gauge", "seconds since the agent started", me, snap["uptime"]
    )
    out.add(
        "distgrad_member_info",
        "gauge",
        "the member's rank, incarnation and state (value 1)",
        _labels(
            worker=w, rank=str(snap["rank"]), incarnation=snap["incarnation"], state=snap["state"]
        ),
        1,
    )
    out.add(
        "distgrad_calls_in_flight_all",
        "gauge",
        "calls sent, not ended",
        me,
        snap["calls_in_flight"],
    )
    out.add(
        "distgrad_requests_in_flight_all",
        "gauge",
        "requests being served (worker threads busy)",
        me,
        snap["requests_in_flight"],
    )
    out.add(
        "distgrad_worker_threads", "gauge", "the worker pool's size", me, snap["worker_threads"]
    )
    out.add(
        "distgrad_worker_threads_idle",
        "gauge",
        "worker threads free now",
        me,
        snap["worker_threads_idle"],
    )
    for peer, p in snap["peers"].items():
        pl = _labels(worker=w, peer=peer)
        out.add(
            "distgrad_calls_in_flight",
            "gauge",
            "calls to the peer not ended yet",
            pl,
            p["calls_in_flight"],
        )
        out.add(
            "distgrad_requests_in_flight",
            "gauge",
            "requests from the peer not answered yet",
            pl,
            p["requests_in_flight"],
        )
        out.add(
            "distgrad_calls_resent",
            "counter",
            "calls sent again on a new connection",
            pl,
            p["calls_resent"],
        )
        out.add(
            "distgrad_requests_served",
            "counter",
            "requests from the peer answered",
            pl,
            p["requests_served"],
        )
        out.add(
            "distgrad_requests_failed",
            "counter",
            "requests answered with an error",
            pl,
            p["requests_failed"],
        )
        out.add(
            "distgrad_requests_refused",
            "counter",
            "messages refused by the allow-list",
            pl,
            p["requests_refused"],
        )
        out.add(
            "distgrad_sent_bytes", "counter", "payload bytes sent to the peer", pl, p["bytes_sent"]
        )
        out.add(
            "distgrad_received_bytes",
            "counter",
            "payload bytes received from the peer",
            pl,
            p["bytes_received"],
        )
    for peer, p in snap["peers"].items():
        for function, f in p["functions"].items():
            for outcome, count in zip(OUTCOMES, (f["outcomes"][o] for o in OUTCOMES), strict=True):
                out.add(
                    "distgrad_calls",
                    "counter",
                    "calls to the peer, by function and outcome",
                    _labels(worker=w, peer=peer, function=function, outcome=outcome),
                    count,
                )
    help_latency = "seconds from a call's sending to its end, by peer and function"
    name = "distgrad_call_latency_seconds"
    for peer, p in snap["peers"].items():
        for function, f in p["functions"].items():
            cumulative = 0
            for bound, count in zip([*snap["latency_bounds"], None], f["buckets"], strict=True):
                cumulative += count
                le = "+Inf" if bound is None else repr(float(bound))
                labels = _labels(worker=w, peer=peer, function=function, le=le)
                out.add_line(name, "histogram", help_latency, f"{name}_bucket{labels} {cumulative}")
            labels = _labels(worker=w, peer=peer, function=function)
            out.add_line(
                name, "histogram", help_latency, f"{name}_sum{labels} {_number(f['seconds'])}"
            )
            out.add_line(name, "histogram", help_latency, f"{name}_count{labels} {cumulative}")
    for name_, flag in (("suspected", "distgrad_peer_suspected"), ("dead", "distgrad_peer_dead")):
        for peer in snap["members"]:
            if peer != w:
                out.add(
                    flag,
                    "gauge",
                    f"1 while this member holds the peer {name_}",
                    _labels(worker=w, peer=peer),
                    peer in snap[name_],
                )
    for event in snap["peer_events"]:
        out.add(
            "distgrad_peer_events",
            "counter",
            "verdicts on peers (suspected, dead, recovered, restarted), by cause",
            _labels(worker=w, peer=event["peer"], kind=event["kind"], cause=event["cause"]),
            event["count"],
        )
    for kind, count in sorted(snap["membership"].items()):
        out.add(
            "distgrad_membership_events",
            "counter",
            "members joined, left, restarted",
            _labels(worker=w, kind=kind),
            count,
        )
    t = snap["transport"]
    for key, kind, help_ in (
        ("open_connections", "gauge", "connections open now"),
        ("connections_opened", "counter", "connections this member dialled (reconnections too)"),
        ("connections_accepted", "counter", "connections this member accepted"),
        ("handshakes_failed", "counter", "handshakes refused (wrong secret, bad peer)"),
        ("protocol_errors", "counter", "connections dropped for a protocol error"),
        ("stalls", "counter", "heartbeat ticks that found this process stalled"),
        ("bytes_through_ring", "counter", "tensor bytes taken from peers' shared-memory rings"),
        ("bytes_read_directly", "counter", "tensor bytes read straight from peers' memory"),
        ("ring_bytes_lent", "gauge", "bytes of peers' rings that received tensors hold now"),
    ):
        out.add(f"distgrad_transport_{key}", kind, help_, me, t[key])
    for key, value in sorted(snap["layers"].items()):
        kind = "counter" if key.endswith("_total") else "gauge"
        out.add(f"distgrad_{key}", kind, f"layer figure {key}", me, value)
    proc = snap["process"]
    out.add(
        "distgrad_process_resident_bytes", "gauge", "resident memory", me, proc["resident_bytes"]
    )
    out.add(
        "distgrad_process_peak_resident_bytes",
        "gauge",
        "peak resident memory",
        me,
        proc["peak_resident_bytes"],
    )
    out.add(
        "distgrad_process_cpu_seconds",
        "counter",
        "CPU seconds of the process",
        me,
        proc["cpu_seconds"],
    )
    return "\n".join(out.lines()) + "\n"
