"""A/B of two distgrad source trees on the MLP step of ``autograd_bench.py`` (distgrad only).

A change worth a few per cent is invisible in runs taken minutes apart on a noisy host (the
one-process step of the same code moves by 1.5x and more). This alternates the two trees in
pairs of short runs -- old, new, old, new, ... each a fresh 2-process group -- and reports the
median of the per-pair ratios, which drift slower than one pair cancels out of.

Usage::

    git worktree add /tmp/old <rev>          # the tree to compare against
    python benchmarks/ab_autograd.py /tmp/old/src src [--pairs 8] [--iters 200] [--batch 32]

Reported per run: the step and backward medians (µs) and worker0's process CPU per step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import run_group, run_in_tree
from autograd_bench import HIDDEN, remote_layer

KEYS = ("step_us", "backward_us", "cpu0_us")
_WARMUP = 30


def caller(rpc: Any, dst: str, cfg: dict[str, Any]) -> dict[str, float]:
    import torch

    import distgrad.autograd as dist_autograd

    torch.manual_seed(0)
    first = torch.nn.Sequential(torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.ReLU())
    head = torch.nn.Linear(HIDDEN, 10)
    x = torch.randn(cfg["batch"], HIDDEN)
    target = torch.randint(0, 10, (cfg["batch"],))
    steps: list[float] = []
    backwards: list[float] = []
    cpu_start = 0.0
    for i in range(cfg["iters"] + _WARMUP):
        if i == _WARMUP:
            cpu_start = time.process_time()
        t0 = time.perf_counter()
        with dist_autograd.context() as cid:
            h = rpc.rpc_sync(dst, remote_layer, args=(first(x),))
            loss = torch.nn.functional.cross_entropy(head(h), target)
            t1 = time.perf_counter()
            dist_autograd.backward(cid, [loss])
            t2 = time.perf_counter()
            dist_autograd.get_gradients(cid)
        t3 = time.perf_counter()
        if i >= _WARMUP:
            steps.append(t3 - t0)
            backwards.append(t2 - t1)
    cpu = (time.process_time() - cpu_start) / cfg["iters"]
    return {
        "step_us": statistics.median(steps) * 1e6,
        "backward_us": statistics.median(backwards) * 1e6,
        "cpu0_us": cpu * 1e6,
    }


def _one(iters: int, batch: int) -> int:
    """One group with whatever distgrad is importable (the parent sets PYTHONPATH)."""
    result = run_group("distgrad", caller, {"iters": iters, "batch": batch}, timeout=300)
    if not result.ok:
        print(result.log_tail, file=sys.stderr)
        return 1
    print(json.dumps(result.value))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old", nargs="?", help="the src/ folder of the tree to compare against")
    parser.add_argument("new", nargs="?", help="the src/ folder of the tree under test")
    parser.add_argument("--pairs", type=int, default=8)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        return _one(args.iters, args.batch)
    if not (args.old and args.new):
        parser.error("give the old and the new src/ folders")
    runs: dict[str, list[dict[str, float]]] = {"old": [], "new": []}
    for pair in range(args.pairs):
        for name, tree in (("old", args.old), ("new", args.new)):
            value = run_in_tree(
                __file__,
                tree,
                ["--one", "--iters", str(args.iters), "--batch", str(args.batch)],
                400,
            )
            runs[name].append(value)
            shown = " ".join(f"{k}={value[k]:.0f}" for k in KEYS)
            print(f"pair {pair + 1} {name}: {shown}", flush=True)
    print()
    for key in KEYS:
        old = [r[key] for r in runs["old"]]
        new = [r[key] for r in runs["new"]]
        ratios = [n / o for o, n in zip(old, new, strict=True)]
        print(
            f"{key:12s} old {statistics.median(old):8.0f}  new {statistics.median(new):8.0f}  "
            f"new/old per pair: median {statistics.median(ratios):.3f} "
            f"({' '.join(f'{r:.2f}' for r in ratios)})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
