"""``distgrad demo``: train a digit classifier split across local worker processes.

The command starts ``--workers`` processes on this machine, reports their start-up (importing
torch, meeting over RPC on 127.0.0.1), trains (``--layout pipeline`` or ``ps``), prints a
progress bar with the loss and the test accuracy per epoch, and ends by checking that one
distributed step's gradients equal single-process torch autograd's. Ctrl-C stops every worker.
What each layout does is described in ``distgrad._demo._work``; ``--help`` shows the same in
plain text.
"""

from __future__ import annotations

import argparse
import importlib.util
import multiprocessing as mp
import os
import queue
import signal
import socket
import sys
import time
from typing import Any

__all__ = ["add_parser", "run"]

#: How long worker0 waits for the parent to report the start-up before it prints anyway.
_GO_WAIT_S = 30.0


_DESCRIPTION = """\
Train a digit classifier (scikit-learn's bundled 8x8 digits) split across local worker
processes that work together over distgrad's RPC, then check that one distributed step's
gradients equal single-process torch autograd's.

layouts:
  pipeline  worker0 holds the data; the model's layers are split into stages on workers
            1..N-1; each batch travels as micro-batches in flight at once, and
            dist_autograd.backward sends the gradients back along the same hops
  ps        worker0 is a parameter server holding the model; workers 1..N-1 are trainers,
            each with a shard of the data and a RemoteModule sharing the server's model;
            they take turns from forward to optimizer step in a fixed order, so a seed
            gives the same numbers on every run

The workers start first (each imports torch, then they meet over RPC on 127.0.0.1);
progress is printed meanwhile. Ctrl-C stops every worker.
"""


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Register ``demo`` on the CLI's subparsers; returns its parser."""
    demo: argparse.ArgumentParser = sub.add_parser(
        "demo",
        help="train a model split across local worker processes",
        description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    demo.add_argument(
        "--workers", type=int, default=3, metavar="N", help="worker processes (default 3)"
    )
    demo.add_argument(
        "--layout",
        choices=("pipeline", "ps"),
        default="pipeline",
        help="pipeline: model stages on workers 1..N-1; ps: a parameter server and N-1 "
        "trainers (default pipeline)",
    )
    demo.add_argument(
        "--epochs", type=int, default=8, metavar="N", help="passes over the data (default 8)"
    )
    demo.add_argument(
        "--batch-size", type=int, default=32, metavar="N", help="examples per step (default 32)"
    )
    demo.add_argument(
        "--micro-batches",
        type=int,
        default=4,
        metavar="N",
        help="pieces each batch is cut into, pipeline only (default 4)",
    )
    demo.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (default 0.05)")
    demo.add_argument("--seed", type=int, default=0, help="model and data seed (default 0)")
    demo.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        metavar="S",
        help="give up after this many seconds, worker start-up included (default 600)",
    )
    return demo


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
    if problem is None and importlib.util.find_spec("sklearn") is None:
        # fail here, at once, rather than in every worker after it imported torch
        problem = (
            "the demo trains on scikit-learn's bundled digits data set: "
            "pip install 'distgrad[demo]' (or pip install scikit-learn)"
        )
    if problem is not None:
        print(f"distgrad demo: {problem}", file=sys.stderr)
        return 2
    print(
        f"distgrad demo: layout {args.layout!r}, {args.workers} worker processes on this "
        "machine (starting them: each imports torch, then they meet over RPC)",
        flush=True,
    )
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    ctx = mp.get_context("spawn")
    events: Any = ctx.Queue()
    go: Any = ctx.Event()
    options = vars(args).copy()
    procs = [
        ctx.Process(
            target=_worker, args=(rank, port, options, events, go), name=f"distgrad-demo-{rank}"
        )
        for rank in range(args.workers)
    ]
    startup = _Startup(args.workers)
    for proc in procs:
        proc.start()
    try:
        deadline = time.monotonic() + args.timeout
        while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
            failed = [p for p in procs if p.exitcode not in (None, 0)]
            if failed:  # one failed: the others would wait for it forever
                break
            if not go.is_set():
                startup.poll(events)
                if startup.complete:
                    go.set()  # worker0 prints from here on
            time.sleep(0.05)
    except KeyboardInterrupt:
        startup.end_line()
        print("\ndistgrad demo: interrupted, stopping the workers", file=sys.stderr)
        _stop(procs)
        return 130
    timed_out = any(p.is_alive() for p in procs) and time.monotonic() >= deadline
    startup.end_line()
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


class _Startup:
    """Reports the workers' start-up as it happens: each worker says when it has imported
    torch and distgrad, and when it has joined the RPC group. On a terminal one line counts
    up live; otherwise a line is printed when every worker has reached a phase."""

    _PHASES = (("imported", "imported torch and distgrad"), ("joined", "joined the RPC group"))

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self.started = time.monotonic()
        self.live = sys.stdout.isatty()
        self.reached: dict[str, set[int]] = {phase: set() for phase, _ in self._PHASES}
        self._reported: set[str] = set()
        self._line_open = False

    @property
    def complete(self) -> bool:
        return all(len(ranks) == self.workers for ranks in self.reached.values())

    def poll(self, events: Any) -> None:
        changed = False
        while True:
            try:
                rank, phase = events.get_nowait()
            except queue.Empty:
                break
            self.reached[phase].add(rank)
            changed = True
        if changed or self.live:
            self._show()

    def _show(self) -> None:
        elapsed = time.monotonic() - self.started
        if self.live:
            counts = ", ".join(
                f"{len(self.reached[phase])}/{self.workers} {what}" for phase, what in self._PHASES
            )
            print(f"\r  workers: {counts} ({elapsed:.1f} s)", end="", flush=True)
            self._line_open = True
            if self.complete:
                self.end_line()
            return
        for phase, what in self._PHASES:
            if phase not in self._reported and len(self.reached[phase]) == self.workers:
                self._reported.add(phase)
                print(
                    f"  {self.workers}/{self.workers} workers {what} ({elapsed:.1f} s)", flush=True
                )

    def end_line(self) -> None:
        if self._line_open:
            print(flush=True)
            self._line_open = False


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


def _worker(rank: int, port: int, options: dict[str, Any], events: Any, go: Any) -> None:
    # Ctrl-C reaches the whole process group; the parent stops the workers in order.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    import distgrad.rpc as rpc

    events.put((rank, "imported"))
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
    events.put((rank, "joined"))
    ok = True
    try:
        if rank == 0:
            from ._driver import drive

            go.wait(_GO_WAIT_S)  # the parent has printed the start-up lines
            ok = drive(args)
    finally:
        rpc.shutdown()
    if not ok:
        raise SystemExit(1)
