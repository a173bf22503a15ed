"""``distgrad demo``: train a digit classifier split across local worker processes.

The command starts ``--workers`` processes on this machine, joins them with distgrad's RPC over
127.0.0.1, trains (``--layout pipeline`` or ``ps``), prints a progress bar with the loss and the
test accuracy per epoch, and ends by checking that one distributed step's gradients equal
single-process torch autograd's. Ctrl-C stops every worker. What each layout does is described
in :mod:`distgrad._demo._work`.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import signal
import socket
import sys
import time
from typing import Any

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    demo = sub.add_parser(
        "demo",
        help="train a model split across local worker processes",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    demo.add_argument("--workers", type=int, default=3, help="worker processes (default 3)")
    demo.add_argument(
        "--layout",
        choices=("pipeline", "ps"),
        default="pipeline",
        help="pipeline: model stages on workers 1..N-1; ps: a parameter server and N-1 "
        "trainers (default pipeline)",
    )
    demo.add_argument("--epochs", type=int, default=8, help="passes over the data (default 8)")
    demo.add_argument("--batch-size", type=int, default=32, help="examples per step (default 32)")
    demo.add_argument("--micro-batches", type=int, default=4, help="pipeline only (default 4)")
    demo.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (default 0.05)")
    demo.add_argument("--seed", type=int, default=0, help="model and data seed (default 0)")
    demo.add_argument("--timeout", type=float, default=600.0, help="give up after (s)")


def _check(args: argparse.Namespace) -> str | None:
    from ._work import MAX_STAGES

    if args.workers < 2:
        return "--workers must be at least 2 (a driver and one more worker)"
    if args.layout == "pipeline" and args.workers - 1 > MAX_STAGES:
        return f"--layout pipeline supports at most {MAX_STAGES + 1} workers (one per layer)"
    if args.epochs < 1:
        return "--epochs must be at least 1"
    if args.batch_size < 1:
        return "--batch-size must be at least 1"
    if not 1 <= args.micro_batches <= args.batch_size:
        return "--micro-batches must be between 1 and --batch-size"
    if args.lr <= 0:
        return "--lr must be positive"
    if args.timeout <= 0:
        return "--timeout must be positive"
    return None


def run(args: argparse.Namespace) -> int:
    problem = _check(args)
    if problem is None:
        try:
            import sklearn  # noqa: F401  (fail here, not in every worker)
        except ImportError:
            problem = (
                "the demo trains on scikit-learn's bundled digits data set: "
                "pip install 'distgrad[demo]' (or pip install scikit-learn)"
            )
    if problem is not None:
        print(f"distgrad demo: {problem}", file=sys.stderr)
        return 2
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    ctx = mp.get_context("spawn")
    options = vars(args).copy()
    procs = [
        ctx.Process(target=_worker, args=(rank, port, options), name=f"distgrad-demo-{rank}")
        for rank in range(args.workers)
    ]
    for proc in procs:
        proc.start()
    try:
        deadline = time.monotonic() + args.timeout
        while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
            failed = [p for p in procs if p.exitcode not in (None, 0)]
            if failed:  # one failed: the others would wait for it forever
                break
            time.sleep(0.05)
    except KeyboardInterrupt:
        print("\ndistgrad demo: interrupted, stopping the workers", file=sys.stderr)
        _stop(procs)
        return 130
    timed_out = any(p.is_alive() for p in procs) and time.monotonic() >= deadline
    _stop(procs)
    if timed_out:
        print(f"distgrad demo: gave up after {args.timeout:g} s", file=sys.stderr)
        return 1
    failed_ranks = [rank for rank, p in enumerate(procs) if p.exitcode != 0]
    if failed_ranks:
        codes = ", ".join(f"worker{r}: {procs[r].exitcode}" for r in failed_ranks)
        print(f"distgrad demo: failed ({codes})", file=sys.stderr)
        return 1
    return 0


def _stop(procs: list[Any]) -> None:
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    deadline = time.monotonic() + 3.0
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join(5)


def _worker(rank: int, port: int, options: dict[str, Any]) -> None:
    # Ctrl-C reaches the whole process group; the parent stops the workers in order.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    import distgrad.rpc as rpc

    torch.set_num_threads(1)
    args = argparse.Namespace(**options)
    rpc.init_rpc(
        f"worker{rank}",
        rank=rank,
        world_size=args.workers,
        rpc_backend_options=rpc.TensorPipeRpcBackendOptions(
            init_method=f"tcp://127.0.0.1:{port}", rpc_timeout=120
        ),
    )
    ok = True
    try:
        if rank == 0:
            from ._driver import drive

            ok = drive(args)
    finally:
        rpc.shutdown()
    if not ok:
        raise SystemExit(1)
