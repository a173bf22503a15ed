"""A/B of two distgrad source trees on small calls (``rpc_sync`` no-op latency, ``rpc_async``
throughput), each round also measuring the floor: a 16-byte Unix-socket ping-pong between two
Python processes (``_pingpong``).

Rounds alternate the trees in ABBA order (old, new, new, old, ...), each group a fresh 2-process
group running ``rpc_bench.caller``; reported are the medians over all samples of each tree, the
median of the per-round ratios new/old (which a host whose load drifts moves less), and each
tree's latency as a multiple of the ping-pong of the same round.

Usage::

    git worktree add --detach /tmp/base <rev>       # the tree to compare against
    python benchmarks/ab_rpc.py /tmp/base/src src [--rounds 6] [--latency-iters 5000]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import load_average, run_group, run_in_tree
from _pingpong import pingpong_us
from rpc_bench import caller


def _one(cfg: dict[str, Any]) -> int:
    """One group with whatever distgrad is importable (the parent sets PYTHONPATH)."""
    result = run_group("distgrad", caller, cfg, timeout=600)
    if not result.ok:
        print(result.log_tail, file=sys.stderr)
        return 1
    value = result.value
    print(
        json.dumps(
            {
                "latency_us": statistics.median(value["latency_us"]),
                "async_per_s": statistics.median(value["async_rate"]),
            }
        )
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old", nargs="?", help="the src/ folder of the tree to compare against")
    parser.add_argument("new", nargs="?", help="the src/ folder of the tree under test")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--latency-iters", type=int, default=5000)
    parser.add_argument("--async-calls", type=int, default=2000)
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        return _one(json.loads(args.one))
    if not (args.old and args.new):
        parser.error("give the old and the new src/ folders")
    cfg = {
        "only": ["latency", "async"],
        "lat_iters": args.latency_iters,
        "lat_warmup": 500,
        "async_calls": args.async_calls,
        "async_reps": 3,
        "sizes": [],
    }
    print(f"load average at start {load_average()}", flush=True)
    rows: list[dict[str, float]] = []
    for rnd in range(args.rounds):
        floor = statistics.median(pingpong_us(10000, 1000))
        order = (("old", args.old), ("new", args.new))
        if rnd % 2:
            order = order[::-1]
        row = {"floor": floor}
        for name, tree in order:
            value = run_in_tree(__file__, tree, ["--one", json.dumps(cfg)], 700)
            row[f"{name}_latency"] = value["latency_us"]
            row[f"{name}_async"] = value["async_per_s"]
        rows.append(row)
        print(
            f"round {rnd + 1}: ping-pong {floor:.1f} µs | old {row['old_latency']:.1f} µs, "
            f"{row['old_async']:,.0f} calls/s | new {row['new_latency']:.1f} µs, "
            f"{row['new_async']:,.0f} calls/s",
            flush=True,
        )

    def med(key: str) -> float:
        return statistics.median(r[key] for r in rows)

    def ratio(num: str, den: str) -> float:
        return statistics.median(r[num] / r[den] for r in rows)

    print()
    print(f"ping-pong (16 B, 2 Python processes): median {med('floor'):.1f} µs")
    for name in ("old", "new"):
        print(
            f"{name}: rpc_sync {med(f'{name}_latency'):.1f} µs "
            f"({ratio(f'{name}_latency', 'floor'):.2f}x the ping-pong of its round), "
            f"rpc_async {med(f'{name}_async'):,.0f} calls/s"
        )
    print(
        f"new/old per round, median: rpc_sync latency {ratio('new_latency', 'old_latency'):.3f}, "
        f"rpc_async throughput {ratio('new_async', 'old_async'):.3f}"
    )
    print(f"load average at the end {load_average()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
