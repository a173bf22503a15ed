"""The command line: ``distgrad demo``.

The demo starts local worker processes that talk over distgrad's RPC: the first worker (the
"driver") splits a matrix product across the others with ``rpc_async``, checks the result
against a local computation, measures small-call latency and tensor throughput, and shuts the
group down gracefully.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time
from typing import Any

from . import _launcher

__all__ = ["main"]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _matmul_block(a: Any, b: Any) -> Any:
    return a @ b


def _noop() -> None:
    return None


def _echo(x: Any) -> Any:
    return x


def _driver(world_size: int, steps: int, size: int) -> None:
    import torch

    import distgrad.rpc as rpc

    workers = [f"worker{r}" for r in range(1, world_size)]
    torch.manual_seed(0)
    a = torch.randn(size, size)
    b = torch.randn(size, size)
    print(f"[driver] {len(workers)} workers: splitting a {size}x{size} matmul by rows")
    blocks = torch.chunk(a, len(workers))

    def step() -> Any:
        pairs = zip(workers, blocks, strict=True)
        futures = [rpc.rpc_async(w, _matmul_block, args=(blk, b)) for w, blk in pairs]
        return torch.cat([f.wait() for f in futures])

    torch.testing.assert_close(step(), a @ b)
    print("[driver] distributed result equals the local matmul")
    started = time.perf_counter()
    for _ in range(steps):
        step()
    per_step = (time.perf_counter() - started) / steps * 1e3
    print(f"[driver] {steps} steps, {per_step:.2f} ms per step")

    latencies = []
    for _ in range(200):
        t0 = time.perf_counter()
        rpc.rpc_sync(workers[0], _noop)
        latencies.append(time.perf_counter() - t0)
    print(f"[driver] no-op rpc_sync round trip: median {statistics.median(latencies) * 1e6:.0f} us")

    payload = torch.randn(4 * 1024 * 1024)  # 16 MiB
    times = []
    for _ in range(15):
        t0 = time.perf_counter()
        back = rpc.rpc_sync(workers[-1], _echo, args=(payload,))
        times.append(time.perf_counter() - t0)
    assert torch.equal(back, payload)
    rate = 2 * payload.numel() * 4 / statistics.median(times[5:]) / 1e9
    print(f"[driver] 16 MiB tensor echo: {rate:.2f} GB/s (both directions counted)")


def _worker(rank: int, world_size: int, port: int, steps: int, size: int) -> None:
    import distgrad.rpc as rpc

    options = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}")
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size, rpc_backend_options=options)
    try:
        if rank == 0:
            _driver(world_size, steps, size)
    finally:
        rpc.shutdown()


def _demo(args: argparse.Namespace) -> int:
    if args.workers < 2:
        print("distgrad demo: --workers must be at least 2", file=sys.stderr)
        return 2
    if args.steps < 1 or args.size < args.workers:
        print("distgrad demo: --steps must be >= 1 and --size >= --workers", file=sys.stderr)
        return 2
    port = _free_port()
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=_worker, args=(r, args.workers, port, args.steps, args.size))
        for r in range(args.workers)
    ]
    for p in procs:
        p.start()
    try:
        deadline = time.monotonic() + args.timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
    except KeyboardInterrupt:
        print("\ndistgrad demo: interrupted, stopping workers", file=sys.stderr)
        return 130
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    failed = [r for r, p in enumerate(procs) if p.exitcode != 0]
    if failed:
        print(f"distgrad demo: workers {failed} failed", file=sys.stderr)
        return 1
    print("distgrad demo: done")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="distgrad", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run the multi-worker demo on this machine")
    demo.add_argument("--workers", type=int, default=3, help="number of worker processes")
    demo.add_argument("--steps", type=int, default=20, help="distributed matmul steps")
    demo.add_argument("--size", type=int, default=512, help="matrix size")
    demo.add_argument("--timeout", type=float, default=300.0, help="give up after (s)")
    _launcher.add_parser(sub)
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.command == "demo":
        return _demo(args)
    if args.command == "run":
        return _launcher.run(args)
    return 2
