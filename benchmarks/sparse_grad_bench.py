"""A large sparse step: ``nn.Embedding(1_000_000, 64, sparse=True)`` on worker1, looked up over
RPC by worker0, then the distributed backward. Reports the backward's median time and the
median growth of worker1's resident memory during a backward (sampled every millisecond):
the gradient's values tensor is ``rows x 64`` floats, taken over without a copy when nothing
else refers to it (issue 23, item 5).

Usage::

    python benchmarks/sparse_grad_bench.py [--impl distgrad|torch] [--rows 200000] [--iters 10]

For a before/after comparison run it with ``PYTHONPATH`` pointing at each source tree.
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

from _common import run_group

_TABLE: dict[str, Any] = {}


def lookup(indices: Any) -> Any:
    """The embedding lookup on worker1 (the table is made on first use)."""
    import torch

    if "emb" not in _TABLE:
        torch.manual_seed(0)
        _TABLE["emb"] = torch.nn.Embedding(1_000_000, 64, sparse=True)
    return _TABLE["emb"](indices)


def _resident() -> int:
    """This process's resident memory now (bytes, from /proc/self/statm)."""
    import os

    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def start_sampling() -> int:
    """Sample worker1's resident memory every millisecond until :func:`stop_sampling`;
    return it now."""
    import threading

    now = _resident()
    _TABLE["peak"] = now
    stop = _TABLE["stop"] = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            _TABLE["peak"] = max(_TABLE["peak"], _resident())
            stop.wait(0.001)

    thread = _TABLE["sampler"] = threading.Thread(target=sample, daemon=True)
    thread.start()
    return now


def stop_sampling() -> int:
    """Stop sampling; the highest resident memory seen (bytes)."""
    _TABLE["stop"].set()
    _TABLE["sampler"].join()
    return int(_TABLE["peak"])


def caller(rpc: Any, dst: str, cfg: dict[str, Any]) -> dict[str, float]:
    import torch

    if rpc.__name__.startswith("torch"):
        import torch.distributed.autograd as dist_autograd
    else:
        import distgrad.autograd as dist_autograd

    torch.manual_seed(1)
    indices = torch.randint(0, 1_000_000, (cfg["rows"],))
    backwards: list[float] = []
    growths: list[int] = []
    for i in range(cfg["iters"]):
        with dist_autograd.context() as cid:
            out = rpc.rpc_sync(dst, lookup, args=(indices,))
            loss = (out * out).sum()  # (a dense gradient of rows x 64 floats goes back)
            sampled = i % 2 == 1  # (every other step: the sampler's thread costs time)
            before = rpc.rpc_sync(dst, start_sampling) if sampled else 0
            t0 = time.perf_counter()
            dist_autograd.backward(cid, [loss])
            if sampled:
                growths.append(rpc.rpc_sync(dst, stop_sampling) - before)
            else:
                backwards.append(time.perf_counter() - t0)
    return {
        "backward_ms": statistics.median(backwards) * 1e3,
        "backward_peak_growth_mib": statistics.median(growths) / 2**20,
        "values_mib": cfg["rows"] * 64 * 4 / 2**20,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--impl", choices=("distgrad", "torch"), default="distgrad")
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args()
    result = run_group(args.impl, caller, {"rows": args.rows, "iters": args.iters}, timeout=600)
    if not result.ok:
        print(result.log_tail, file=sys.stderr)
        return 1
    print(json.dumps(result.value))
    return 0


if __name__ == "__main__":
    sys.exit(main())
