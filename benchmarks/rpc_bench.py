"""RPC benchmark: torch.distributed.rpc (TensorPipe) vs distgrad.rpc, side by side.

Run from the repository root::

    PYTHONPATH=src python benchmarks/rpc_bench.py            # full run (~2 min on 2 cores)
    PYTHONPATH=src python benchmarks/rpc_bench.py --quick    # smoke run (~30 s)
    PYTHONPATH=src python benchmarks/rpc_bench.py --netns    # between two netns "hosts" (root)
    PYTHONPATH=src python benchmarks/rpc_bench.py --netns --tls   # distgrad over mutual TLS

With ``--netns`` the caller and the callee run in two network namespaces joined by veth pairs
to a bridge (``tests/_netns.py``): traffic crosses a real TCP path between "hosts" (no Unix
sockets, no same-host memory reads), as between machines; TensorPipe is pinned to that
interface and to what it uses between machines (its ``uv`` transport and ``basic`` channel:
its CMA channel would otherwise read the peer's memory, as the namespaces share one kernel).
``--tls`` adds mutual TLS to distgrad's connections (TensorPipe has no TLS: it runs in
plaintext beside it).

Each implementation runs in its own freshly spawned 2-process group (caller ``worker0``,
callee ``worker1``, rendezvous on ``tcp://127.0.0.1:<free port>``). The groups are
interleaved in rounds (torch, distgrad, torch, distgrad, ...) so that drift on a noisy
machine affects both alike, and every figure is a median over the samples of all rounds.
Every round also measures the floor under both (with ``latency``): a 16-byte ping-pong between
two Python processes over a Unix socket, blocking I/O (``_pingpong.py``); each
implementation's ``rpc_sync`` median is reported as a multiple of it. And the floor of a Python
RPC: the least a call can do (pickled request behind a header, unpickled and called, its result
pickled back; ``_pingpong.minimal_rpc``), with its CPU per call on each side.
See benchmarks/README.md for what each metric means and the targets.
"""

from __future__ import annotations

import argparse
import gc
import math
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

from _common import (
    IMPLEMENTATIONS,
    GroupResult,
    Placement,
    echo,
    ensure_distgrad_importable,
    environment_info,
    format_size,
    load_average,
    median,
    noop,
    parse_size,
    percentile,
    print_table,
    run_group,
    snapshot_package,
    write_json,
)
from _pingpong import minimal_rpc, pin_pair, pingpong_us

METRICS = ("latency", "async", "echo")
DEFAULT_SIZES = "1KiB,64KiB,1MiB,16MiB,64MiB"
# Targets from the issue, as bounds on the ratio distgrad / torch.
# the targets of issue 28
LATENCY_TARGET = 0.4  # distgrad/torch small-call latency must be <= this
FLOOR_TARGET = 4.0  # distgrad rpc_sync no-op / raw 16-byte Unix-socket ping-pong must be <= this
#: ... and / the same ping-pong with its two processes pinned to two different cores
PINNED_FLOOR_TARGET = 1.5
ASYNC_TARGET = 4.0  # distgrad/torch rpc_async throughput must be >= this
ECHO_TARGET = 1.0  # distgrad/torch echo GB/s must be >= this at every size ...
ECHO_MID_TARGET = 2.0  # ... and >= this from 64 KiB to 1 MiB
ECHO_MID_RANGE = (64 * 1024, 1024**2)


# --------------------------------------------------------------------------------------------
# Measurements (run inside the caller process, rank 0)
# --------------------------------------------------------------------------------------------


def bench_latency(rpc: ModuleType, dst: str, iters: int, warmup: int) -> list[float]:
    """Round-trip times (µs) of ``rpc_sync(dst, noop)``, one per call."""
    for _ in range(warmup):
        rpc.rpc_sync(dst, noop)
    gc.collect()
    clock = time.perf_counter_ns
    samples: list[float] = []
    append = samples.append
    for _ in range(iters):
        t0 = clock()
        rpc.rpc_sync(dst, noop)
        append((clock() - t0) / 1e3)
    return samples


def bench_async(rpc: ModuleType, dst: str, calls: int, reps: int) -> list[float]:
    """Calls/s of ``calls`` ``rpc_async(dst, noop)`` issued back to back, then waited for."""
    import torch

    warm = [rpc.rpc_async(dst, noop) for _ in range(min(calls, 500))]
    torch.futures.wait_all(warm)
    rates: list[float] = []
    for _ in range(reps):
        gc.collect()
        t0 = time.perf_counter()
        futures = [rpc.rpc_async(dst, noop) for _ in range(calls)]
        torch.futures.wait_all(futures)
        rates.append(calls / (time.perf_counter() - t0))
        del futures
    return rates


def _make_tensor(nbytes: int) -> Any:
    import torch

    if nbytes % 4 == 0:
        return torch.randn(nbytes // 4, dtype=torch.float32)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8)


def _bit_exact(sent: Any, got: Any) -> tuple[bool, str]:
    import torch

    if not isinstance(got, torch.Tensor):
        return False, f"got {type(got).__name__}, not a tensor"
    if got.dtype != sent.dtype or got.shape != sent.shape:
        return False, f"got {got.dtype}{tuple(got.shape)}, sent {sent.dtype}{tuple(sent.shape)}"
    if not torch.equal(got.contiguous().view(torch.uint8), sent.view(torch.uint8)):
        return False, "bytes differ"
    return True, "ok"


def echo_iters(nbytes: int, cfg: dict[str, Any]) -> int:
    """Timed calls per size: ``echo_bytes`` worth of tensors, clamped to [min, max]."""
    return max(cfg["echo_min_iters"], min(cfg["echo_max_iters"], cfg["echo_bytes"] // nbytes))


def bench_echo(
    rpc: ModuleType, dst: str, nbytes: int, iters: int, cap_s: float, warmup: int
) -> dict[str, Any]:
    """Round-trip times (s) of ``rpc_sync(dst, echo, (t,))``; the first reply is checked.

    A fixed number of calls (so every group weighs the same in the pooled median); ``cap_s``
    only guards against a pathologically slow implementation and is reported when hit.
    """
    t = _make_tensor(nbytes)
    exact, detail = _bit_exact(t, rpc.rpc_sync(dst, echo, (t,)))
    for _ in range(max(0, warmup - 1)):
        rpc.rpc_sync(dst, echo, (t,))
    gc.collect()
    clock = time.perf_counter
    times: list[float] = []
    end = clock() + cap_s
    while len(times) < iters:
        t0 = clock()
        out = rpc.rpc_sync(dst, echo, (t,))
        t1 = clock()
        times.append(t1 - t0)
        del out
        if t1 > end and len(times) >= 3:
            break
    return {"times_s": times, "exact": exact, "detail": detail, "capped": len(times) < iters}


def caller(rpc: ModuleType, dst: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """Everything rank 0 measures in one group; the result goes back to the parent."""
    out: dict[str, Any] = {}
    if "latency" in cfg["only"]:
        out["latency_us"] = bench_latency(rpc, dst, cfg["lat_iters"], cfg["lat_warmup"])
    if "async" in cfg["only"]:
        out["async_rate"] = bench_async(rpc, dst, cfg["async_calls"], cfg["async_reps"])
    if "echo" in cfg["only"]:
        out["echo"] = {
            size: bench_echo(
                rpc, dst, size, echo_iters(size, cfg), cfg["echo_cap_s"], cfg["echo_warmup"]
            )
            for size in cfg["sizes"]
        }
    return out


# --------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="torch.distributed.rpc (TensorPipe) vs distgrad.rpc, side by side.",
    )
    p.add_argument(
        "--rounds", type=int, default=None, help="interleaved rounds (default: 3, --quick: 2)"
    )
    p.add_argument("--quick", action="store_true", help="fewer iterations: a ~1 minute smoke run")
    p.add_argument("--json", metavar="PATH", help="also write all results to this JSON file")
    p.add_argument(
        "--only", nargs="+", choices=METRICS, default=list(METRICS), help="metrics to run (all)"
    )
    p.add_argument(
        "--sizes",
        default=DEFAULT_SIZES,
        help=f"comma-separated echo sizes, K/M/G = KiB/MiB/GiB ({DEFAULT_SIZES})",
    )
    p.add_argument(
        "--latency-iters", type=int, help="timed rpc_sync calls per group (10000, --quick: 1000)"
    )
    p.add_argument(
        "--async-calls",
        type=int,
        help="rpc_async calls in flight per repetition (5000, --quick: 2000)",
    )
    p.add_argument(
        "--group-timeout",
        type=float,
        help="seconds before a group is killed (derived from the work)",
    )
    p.add_argument(
        "--netns",
        action="store_true",
        help="run caller and callee in two network namespaces joined by a bridge (needs root)",
    )
    p.add_argument(
        "--tls",
        action="store_true",
        help="with --netns: distgrad over mutual TLS (TensorPipe: none)",
    )
    p.add_argument(
        "--no-snapshot",
        action="store_true",
        help="import distgrad from the source tree in every group instead of from a copy "
        "taken at start (the copy keeps one run on one version while src/ is being edited)",
    )
    args = p.parse_args(argv)
    try:
        args.size_list = sorted({parse_size(s) for s in args.sizes.split(",") if s.strip()})
    except ValueError as exc:
        p.error(str(exc))
    if "echo" in args.only and not args.size_list:
        p.error("--sizes is empty")
    if args.rounds is None:
        args.rounds = 2 if args.quick else 3
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    if args.tls and not args.netns:
        p.error("--tls goes with --netns (on one host distgrad uses Unix sockets)")
    return args


def make_config(args: argparse.Namespace) -> dict[str, Any]:
    if args.quick:
        cfg = {
            "lat_iters": 1000,
            "lat_warmup": 100,
            "pp_iters": 5000,
            "pp_warmup": 500,
            "async_calls": 2000,
            "async_reps": 2,
            "echo_bytes": 256 * 1024**2,
            "echo_max_iters": 200,
            "echo_min_iters": 5,
            "echo_cap_s": 3.0,
            "echo_warmup": 2,
        }
    else:
        cfg = {
            "lat_iters": 10000,
            "lat_warmup": 1000,
            "pp_iters": 20000,
            "pp_warmup": 2000,
            "async_calls": 5000,
            "async_reps": 5,
            "echo_bytes": 2 * 1024**3,
            "echo_max_iters": 1000,
            "echo_min_iters": 20,
            "echo_cap_s": 10.0,
            "echo_warmup": 3,
        }
    if args.latency_iters:
        cfg["lat_iters"] = args.latency_iters
    if args.async_calls:
        cfg["async_calls"] = args.async_calls
    cfg["only"] = list(args.only)
    cfg["sizes"] = list(args.size_list)
    return cfg


def group_timeout(cfg: dict[str, Any]) -> float:
    """Generous bound for one group: start-up plus a worst case for each measurement."""
    t = 90.0
    if "latency" in cfg["only"]:
        t += 0.005 * (cfg["lat_iters"] + cfg["lat_warmup"])
    if "async" in cfg["only"]:
        t += 0.002 * cfg["async_calls"] * (cfg["async_reps"] + 1)
    if "echo" in cfg["only"]:
        t += len(cfg["sizes"]) * (cfg["echo_cap_s"] + 20.0)
    return t


# --------------------------------------------------------------------------------------------
# Aggregation and report
# --------------------------------------------------------------------------------------------


def _new_samples() -> dict[str, Any]:
    return {"latency_us": [], "async_rate": [], "echo": {}, "exact": {}}


def absorb(samples: dict[str, Any], value: dict[str, Any]) -> None:
    samples["latency_us"] += value.get("latency_us", [])
    samples["async_rate"] += value.get("async_rate", [])
    for size, e in value.get("echo", {}).items():
        samples["echo"].setdefault(size, []).extend(e["times_s"])
        prev = samples["exact"].get(size)
        if prev is None or (prev[0] and not e["exact"]):  # keep the first failure's detail
            samples["exact"][size] = (e["exact"], e["detail"])


def round_summary(value: dict[str, Any]) -> dict[str, Any]:
    """Per-group medians (for the per-round table and the JSON)."""
    s: dict[str, Any] = {}
    if value.get("latency_us"):
        s["latency_median_us"] = median(value["latency_us"])
        s["latency_p90_us"] = percentile(value["latency_us"], 90)
        s["latency_n"] = len(value["latency_us"])
    if value.get("async_rate"):
        s["async_calls_per_s"] = median(value["async_rate"])
        s["async_reps"] = value["async_rate"]
    for size, e in value.get("echo", {}).items():
        t = median(e["times_s"])
        s[f"echo_{size}"] = {
            "median_s": t,
            "gbps": 2 * size / t / 1e9,
            "n": len(e["times_s"]),
            "exact": e["exact"],
            "capped": e.get("capped", False),
        }
    return s


def _fmt(value: float | None) -> str:
    """About 4 significant digits, thousands separated; ``n/a`` for missing / NaN."""
    if value is None or math.isnan(value):
        return "n/a"
    mag = abs(value)
    if mag >= 1000:
        return f"{value:,.0f}"
    if mag >= 100:
        return f"{value:.1f}"
    if mag >= 10:
        return f"{value:.2f}"
    if mag >= 1:
        return f"{value:.3f}"
    return f"{value:.3g}"


def _ratio(d: float, t: float) -> float:
    if math.isnan(t) or math.isnan(d) or t == 0:
        return float("nan")
    return d / t


def build_rows(samples: dict[str, dict[str, Any]], cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """One dict per metric: name, unit, torch, distgrad, ratio, better, target, status."""
    rows: list[dict[str, Any]] = []
    ts, ds = samples["torch"], samples["distgrad"]

    def add(
        name: str,
        unit: str,
        t: float,
        d: float,
        better: str,
        target: tuple[str, float] | None = None,
    ) -> None:
        r = _ratio(d, t)
        status, target_text = "", ""
        if target is not None:
            op, bound = target
            target_text = f"{op} {bound:.2f}x"
            if math.isnan(r):
                status = "n/a"
            elif (op == "<=" and r <= bound) or (op == ">=" and r >= bound):
                status = "PASS"
            else:
                status = "MISS"
        rows.append(
            {
                "metric": name,
                "unit": unit,
                "torch": t,
                "distgrad": d,
                "ratio": r,
                "better": better,
                "target": target_text,
                "status": status,
            }
        )

    if "latency" in cfg["only"]:
        lat_t, lat_d = ts["latency_us"], ds["latency_us"]
        add(
            "rpc_sync no-op latency, median",
            "µs",
            median(lat_t),
            median(lat_d),
            "lower",
            ("<=", LATENCY_TARGET),
        )
        add(
            "rpc_sync no-op latency, p90",
            "µs",
            percentile(lat_t, 90),
            percentile(lat_d, 90),
            "lower",
        )
        floor = samples.get("floor", {}).get("pingpong_us", [])
        if floor:
            pp = median(floor)
            ratio_d = _ratio(median(lat_d), pp)
            status = (
                "n/a" if math.isnan(ratio_d) else ("PASS" if ratio_d <= FLOOR_TARGET else "MISS")
            )
            rows.append(
                {
                    "metric": f"rpc_sync no-op / 16 B ping-pong ({_fmt(pp)} µs)",
                    "unit": "x floor",
                    "torch": _ratio(median(lat_t), pp),
                    "distgrad": ratio_d,
                    "ratio": _ratio(median(lat_d), median(lat_t)),
                    "better": "lower",
                    "target": f"distgrad <= {FLOOR_TARGET:.2f}x floor",
                    "status": status,
                }
            )
        pinned_floor = samples.get("floor", {}).get("pingpong_pinned_us", [])
        if pinned_floor:
            pp = median(pinned_floor)
            ratio_d = _ratio(median(lat_d), pp)
            status = (
                "n/a"
                if math.isnan(ratio_d)
                else ("PASS" if ratio_d <= PINNED_FLOOR_TARGET else "MISS")
            )
            rows.append(
                {
                    "metric": f"rpc_sync no-op / ping-pong on 2 cores ({_fmt(pp)} µs)",
                    "unit": "x floor",
                    "torch": _ratio(median(lat_t), pp),
                    "distgrad": ratio_d,
                    "ratio": _ratio(median(lat_d), median(lat_t)),
                    "better": "lower",
                    "target": f"distgrad <= {PINNED_FLOOR_TARGET:.2f}x floor",
                    "status": status,
                }
            )
        for key, where in (("minimal_rpc_us", ""), ("minimal_rpc_pinned_us", " on 2 cores")):
            floor = samples.get("floor", {}).get(key, [])
            if floor:  # (no target: how far each is from what a Python RPC cannot go under)
                pp = median(floor)
                rows.append(
                    {
                        "metric": f"rpc_sync no-op / minimal Python RPC{where} ({_fmt(pp)} µs)",
                        "unit": "x floor",
                        "torch": _ratio(median(lat_t), pp),
                        "distgrad": _ratio(median(lat_d), pp),
                        "ratio": _ratio(median(lat_d), median(lat_t)),
                        "better": "lower",
                        "target": "",
                        "status": "",
                    }
                )
    if "async" in cfg["only"]:
        add(
            f"rpc_async throughput, {cfg['async_calls']} in flight",
            "calls/s",
            median(ts["async_rate"]),
            median(ds["async_rate"]),
            "higher",
            (">=", ASYNC_TARGET),
        )
    if "echo" in cfg["only"]:
        for size in cfg["sizes"]:
            tt = median(ts["echo"].get(size, []))
            dt = median(ds["echo"].get(size, []))
            small = min((x for x in (tt, dt) if not math.isnan(x)), default=0.0) < 1e-3
            scale, unit = (1e6, "µs") if small else (1e3, "ms")
            label = f"echo {format_size(size)}"
            add(f"{label}, round trip", unit, tt * scale, dt * scale, "lower")
            mid = ECHO_MID_RANGE[0] <= size <= ECHO_MID_RANGE[1]
            add(
                f"{label}, throughput",
                "GB/s",
                2 * size / tt / 1e9,
                2 * size / dt / 1e9,
                "higher",
                (">=", ECHO_MID_TARGET if mid else ECHO_TARGET),
            )
    return rows


def _fmt_ratio(r: float) -> str:
    return "n/a" if math.isnan(r) else f"{r:.2f}x"


def _exact_text(samples: dict[str, Any], sizes: list[int]) -> str:
    exact = samples["exact"]
    bad = [f"{format_size(s)} ({exact[s][1]})" for s in sizes if s in exact and not exact[s][0]]
    missing = [format_size(s) for s in sizes if s not in exact]
    text = "NOT bit-exact: " + ", ".join(bad) if bad else "bit-exact"
    if missing:
        text += f" (not checked: {', '.join(missing)})"
    return text


def print_report(
    rows: list[dict[str, Any]],
    samples: dict[str, dict[str, Any]],
    per_round: list[dict[str, Any]],
    cfg: dict[str, Any],
) -> None:
    print()
    print("Results: medians over all samples of all rounds; ratio = distgrad / torch")
    print_table(
        ["metric", "unit", "torch", "distgrad", "ratio", "better", "target", "result"],
        [
            [
                r["metric"],
                r["unit"],
                _fmt(r["torch"]),
                _fmt(r["distgrad"]),
                _fmt_ratio(r["ratio"]),
                r["better"],
                r["target"],
                r["status"],
            ]
            for r in rows
        ],
        align="llrrrlll",
    )
    if "echo" in cfg["only"]:
        checks = [f"{impl} {_exact_text(samples[impl], cfg['sizes'])}" for impl in IMPLEMENTATIONS]
        print("Echo check (first reply per size and group): " + "; ".join(checks))
    counts = []
    for impl in IMPLEMENTATIONS:
        s = samples[impl]
        echo_n = "/".join(str(len(s["echo"].get(z, []))) for z in cfg["sizes"])
        counts.append(
            f"{impl} {len(s['latency_us'])} sync calls, {len(s['async_rate'])} async reps, "
            f"echo calls {echo_n}"
        )
    print("Samples: " + "; ".join(counts))

    targets = [r for r in rows if r["status"]]
    if targets:
        print()
        print("Targets (from the issue)")
        for r in targets:
            value = r["distgrad"] if r["unit"] == "x floor" else r["ratio"]
            what = "distgrad" if r["unit"] == "x floor" else "distgrad/torch"
            print(
                f"  {r['status']:<4}  {r['metric']}: {what} = {_fmt_ratio(value)}"
                f" (target {r['target']})"
            )

    # Per-round medians show the run-to-run spread on a noisy machine.
    keys: list[tuple[str, str]] = []
    if "latency" in cfg["only"]:
        keys.append(("latency_median_us", "sync latency median (µs)"))
    if "async" in cfg["only"]:
        keys.append(("async_calls_per_s", "async (calls/s)"))
    if "echo" in cfg["only"]:
        keys += [(f"echo_{s}", f"echo {format_size(s)} (GB/s)") for s in cfg["sizes"]]
    if any(g["impl"] == "ping-pong" for g in per_round):
        print()
    for impl, label in (
        ("ping-pong", "16-byte Unix-socket ping-pong between two Python processes"),
        ("minimal RPC", "minimal RPC"),
        ("minimal RPC pinned", "minimal RPC pinned"),
    ):
        floors = [g for g in per_round if g["impl"] == impl]
        if floors:
            print(
                f"{label}, per round (µs): "
                + ", ".join(f"r{g['round']} {g['median_us']:.1f}" for g in floors)
            )
    for key, label in (
        ("minimal_rpc_cpu", "minimal RPC"),
        ("minimal_rpc_pinned_cpu", "minimal RPC pinned"),
    ):
        found = samples.get("floor", {}).get(key, [])
        if found:
            merged = {
                k: median([c[k] for c in found if k in c])
                for k in ("caller_user_us", "caller_sys_us", "callee_user_us", "callee_sys_us")
                if any(k in c for c in found)
            }
            print(f"{label}, CPU per call, median over rounds: {_cpu_text(merged)}")
    per_round = [g for g in per_round if g["impl"] != "ping-pong"]
    rounds = max((g["round"] for g in per_round), default=0)
    columns = [(impl, r) for impl in IMPLEMENTATIONS for r in range(1, rounds + 1)]
    groups = {(g["impl"], g["round"]): g for g in per_round}
    table = []
    for key, label in keys:
        row = [label]
        for column in columns:
            g = groups.get(column)
            if g is None or not g["ok"]:
                row.append("fail" if g else "-")
                continue
            v = g["summary"].get(key)
            row.append(_fmt(v["gbps"] if isinstance(v, dict) else v))
        table.append(row)
    print()
    print_table(["per-round medians"] + [f"{impl} r{r}" for impl, r in columns], table)


def run_rounds(
    args: argparse.Namespace, cfg: dict[str, Any]
) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]:
    if not args.netns:
        return _run_rounds(args, cfg, None, {})
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tests._netns import Hosts, unavailable

    reason = unavailable()
    if reason is not None:
        raise SystemExit(f"--netns: {reason}")
    with Hosts(2) as hosts, tempfile.TemporaryDirectory() as tmp:
        tls = None
        if args.tls:
            tls = (f"{tmp}/cert.pem", f"{tmp}/key.pem")
            names = ",".join(f"IP:{hosts.address(k)}" for k in range(2))
            subprocess.run(
                ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                 "-subj", "/CN=distgrad-bench", "-addext", f"subjectAltName={names}",
                 "-keyout", tls[1], "-out", tls[0]],
                check=True, capture_output=True, timeout=60,
            )  # fmt: skip
        placement = Placement(
            netns=(hosts.names[0], hosts.names[1]),
            master=hosts.address(0),
            tls=tls,
            # what TensorPipe uses between machines: the namespaces share one kernel, and its
            # CMA channel and shm transport would read the peer's memory directly
            torch_channels=("basic",),
            torch_transports=("uv",),
        )
        pinned = {"TP_SOCKET_IFNAME": "eth0", "GLOO_SOCKET_IFNAME": "eth0"}
        return _run_rounds(args, cfg, placement, pinned)


def _cpu_text(cpu: dict[str, float]) -> str:
    """A minimal RPC's CPU per call on each side, as printed."""
    return (
        f"caller {cpu.get('caller_user_us', math.nan):.1f} + "
        f"{cpu.get('caller_sys_us', math.nan):.1f} µs (user + sys), "
        f"callee {cpu.get('callee_user_us', math.nan):.1f} + "
        f"{cpu.get('callee_sys_us', math.nan):.1f} µs"
    )


def _run_rounds(
    args: argparse.Namespace,
    cfg: dict[str, Any],
    placement: Placement | None,
    env: dict[str, str],
) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]:
    samples = {impl: _new_samples() for impl in IMPLEMENTATIONS}
    samples["floor"] = {
        "pingpong_us": [],
        "pingpong_pinned_us": [],
        "minimal_rpc_us": [],
        "minimal_rpc_pinned_us": [],
        "minimal_rpc_cpu": [],  # (a dict per round, as minimal_rpc gives it)
        "minimal_rpc_pinned_cpu": [],
    }
    pins = pin_pair()
    per_round: list[dict[str, Any]] = []
    timeout = args.group_timeout or group_timeout(cfg)
    for rnd in range(1, args.rounds + 1):
        if "latency" in cfg["only"]:  # the floor, in the same round as the RPCs it bounds
            pp = pingpong_us(cfg["pp_iters"], cfg["pp_warmup"])
            samples["floor"]["pingpong_us"] += pp
            per_round.append(
                {"round": rnd, "impl": "ping-pong", "ok": True, "median_us": median(pp)}
            )
            print(f"  round {rnd}/{args.rounds} ping-pong: {median(pp):.1f} µs", flush=True)
            if pins is not None:  # the same on two different cores: the cross-core floor
                pp = pingpong_us(cfg["pp_iters"], cfg["pp_warmup"], pin=pins)
                samples["floor"]["pingpong_pinned_us"] += pp
                per_round.append(
                    {"round": rnd, "impl": "ping-pong pinned", "ok": True, "median_us": median(pp)}
                )
                print(
                    f"  round {rnd}/{args.rounds} ping-pong pinned to CPUs {pins}: "
                    f"{median(pp):.1f} µs",
                    flush=True,
                )
            for pin in (None, pins) if pins is not None else (None,):
                times, cpu = minimal_rpc(cfg["pp_iters"], cfg["pp_warmup"], pin=pin)
                key = "minimal_rpc" if pin is None else "minimal_rpc_pinned"
                samples["floor"][f"{key}_us"] += times
                samples["floor"][f"{key}_cpu"].append(cpu)
                per_round.append(
                    {
                        "round": rnd,
                        "impl": "minimal RPC" + ("" if pin is None else " pinned"),
                        "ok": True,
                        "median_us": median(times),
                    }
                )
                print(
                    f"  round {rnd}/{args.rounds} minimal Python RPC"
                    f"{'' if pin is None else f' pinned to CPUs {pin}'}: {median(times):.1f} µs, "
                    f"CPU per call {_cpu_text(cpu)}",
                    flush=True,
                )
        # ABBA order (torch, distgrad, distgrad, torch, ...): interleaved, and linear drift
        # over the run cancels out as well as it can.
        order = IMPLEMENTATIONS if rnd % 2 else IMPLEMENTATIONS[::-1]
        for impl in order:
            res = run_group(impl, caller, cfg, timeout=timeout, env=env, placement=placement)
            if not res.ok and res.phase in ("init", "start"):
                print(f"  round {rnd} {impl}: failed during {res.phase}; retrying once", flush=True)
                res = run_group(impl, caller, cfg, timeout=timeout, env=env, placement=placement)
            per_round.append(report_group(rnd, args.rounds, res, samples[impl]))
    return samples, per_round


def report_group(
    rnd: int, rounds: int, res: GroupResult, samples: dict[str, Any]
) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "round": rnd,
        "impl": res.impl,
        "ok": res.ok,
        "wall_s": res.wall_s,
        "error": res.error,
        "notes": res.notes,
    }
    head = f"  round {rnd}/{rounds} {res.impl:<8}"
    if res.ok:
        absorb(samples, res.value)
        summary = round_summary(res.value)
        entry["summary"] = summary
        entry["raw"] = res.value  # every sample, for offline analysis (--json)
        for size, e in res.value.get("echo", {}).items():
            if e.get("capped"):
                res.notes.append(
                    f"echo {format_size(size)}: only {len(e['times_s'])} calls (time cap hit)"
                )
        bits = []
        if "latency_median_us" in summary:
            bits.append(f"latency {summary['latency_median_us']:.1f} µs")
        if "async_calls_per_s" in summary:
            bits.append(f"async {summary['async_calls_per_s']:,.0f} calls/s")
        echo_keys = [k for k in summary if k.startswith("echo_")]
        if echo_keys:
            last = echo_keys[-1]
            bits.append(f"echo {format_size(int(last[5:]))} {summary[last]['gbps']:.2f} GB/s")
        print(f"{head} ok in {res.wall_s:5.1f}s: " + ", ".join(bits), flush=True)
    else:
        print(f"{head} FAILED after {res.wall_s:.1f}s: {res.error}", flush=True)
        if res.log_tail.strip():
            print(res.log_tail.rstrip(), flush=True)
        entry["log_tail"] = res.log_tail
    for note in res.notes:
        print(f"{head} note: {note}", flush=True)
    return entry


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    ensure_distgrad_importable()
    snapshot = None if args.no_snapshot else snapshot_package("distgrad")
    try:
        return _main(args)
    finally:
        if snapshot is not None:
            shutil.rmtree(snapshot, ignore_errors=True)


def _main(args: argparse.Namespace) -> int:
    cfg = make_config(args)
    env = environment_info()
    print("distgrad RPC benchmark: torch.distributed.rpc (TensorPipe) vs distgrad.rpc")
    print(
        f"  python {env['python']} | torch {env['torch']} | distgrad {env['distgrad']} | "
        f"distgrad uses uvloop: {env['distgrad_uvloop']} | CPUs: {env['cpu_count']} "
        f"(usable {env['cpu_affinity']})"
    )
    print(
        f"  distgrad from {env['distgrad_path']} (git {env['git']}) | {env['platform']}"
        f" | {env['date']} | load average {env['loadavg']}"
    )
    if env["distgrad_env"]:
        print(f"  distgrad environment: {env['distgrad_env']}")
    if not env["torch_rpc_available"]:
        print("torch.distributed.rpc is not available in this torch build", file=sys.stderr)
        return 2
    plan = [f"rounds {args.rounds}{' (quick)' if args.quick else ''}"]
    if args.netns:
        plan.append("two netns hosts over TCP" + (" (distgrad: mutual TLS)" if args.tls else ""))
    if "latency" in cfg["only"]:
        plan.append(f"sync latency {cfg['lat_iters']} calls (+{cfg['lat_warmup']} warm-up)")
    if "async" in cfg["only"]:
        plan.append(f"async {cfg['async_calls']} calls x {cfg['async_reps']}")
    if "echo" in cfg["only"]:
        calls = "/".join(str(echo_iters(s, cfg)) for s in cfg["sizes"])
        plan.append(f"echo {','.join(format_size(s) for s in cfg['sizes'])} ({calls} calls)")
    print("  " + " | ".join(plan) + " | per group, per implementation")
    print(flush=True)
    started = time.monotonic()
    samples, per_round = run_rounds(args, cfg)
    rows = build_rows(samples, cfg)
    print_report(rows, samples, per_round, cfg)
    total = time.monotonic() - started
    print(f"\nTotal time {total:.0f}s; load average at the end {load_average()}")
    failures = [g for g in per_round if not g["ok"]]
    failures += [
        s for impl in IMPLEMENTATIONS for s, (ok, _) in samples[impl]["exact"].items() if not ok
    ]
    if args.json:
        write_json(
            args.json,
            {
                "environment": env,
                "command": " ".join(sys.argv),
                "config": cfg,
                "rounds": args.rounds,
                "results": rows,
                "echo_bit_exact": {
                    impl: {str(s): ok for s, (ok, _) in samples[impl]["exact"].items()}
                    for impl in IMPLEMENTATIONS
                },
                "groups": per_round,
                "total_s": total,
            },
        )
        print(f"Wrote {args.json}")
    return 1 if failures else 0  # a group failed or an echo was not bit-exact


if __name__ == "__main__":
    sys.exit(main())
