"""How long a new member takes to join a running dynamic group and reach everyone.

A group of ``N`` members (the leader, rank 0, and ``N - 1`` members, one process each, on this
host) is formed with ``init_rpc(..., world_size=None)``. Then one more process joins and leaves
``--joins`` times; each time it measures, from the start of ``init_rpc`` until it has had an
answer from every member (``rpc_async`` to all, waited together), the *time to reach everyone*.
The median and the range are printed, one line per group size::

    python benchmarks/join_bench.py --members 16 64 --joins 5

Process start-up and ``import torch`` are not counted (the joiner is started once and joins
repeatedly). Every process is killed at the end, whatever happens.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve()
_leave = threading.Event()


def leave_now() -> None:
    _leave.set()


def ping() -> int:
    return 1


def _options(port: int) -> object:
    import distgrad.rpc as rpc

    return rpc.TensorPipeRpcBackendOptions(
        init_method=f"tcp://127.0.0.1:{port}", rpc_timeout=120, num_worker_threads=2
    )


def member(name: str, rank: int, port: int) -> None:
    import distgrad.rpc as rpc

    rpc.init_rpc(name, rank=rank, world_size=None, rpc_backend_options=_options(port))
    print("joined", flush=True)
    _leave.wait(600)
    rpc.shutdown()


def joiner(rank: int, port: int, joins: int) -> None:
    import distgrad.rpc as rpc

    times = []
    for _ in range(joins):
        started = time.perf_counter()
        rpc.init_rpc("joiner", rank=rank, world_size=None, rpc_backend_options=_options(port))
        others = [w for w in rpc.members() if w.name != "joiner"]
        for future in [rpc.rpc_async(w, ping) for w in others]:
            future.wait()
        times.append(time.perf_counter() - started)
        rpc.shutdown()
    print(json.dumps({"members": len(others), "times": times}), flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def measure(size: int, joins: int) -> dict[str, object]:
    """Form a group of ``size`` (leader included), then time ``joins`` joins of one more."""
    import distgrad.rpc as rpc

    port = free_port()
    rpc.init_rpc("m0", rank=0, world_size=None, rpc_backend_options=_options(port))
    procs: list[subprocess.Popen[str]] = []
    env = {**os.environ, "PYTHONPATH": str(HERE.parent.parent / "src")}

    def start(*args: str) -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            [sys.executable, str(HERE), *args], stdout=subprocess.PIPE, text=True, env=env
        )
        procs.append(proc)
        return proc

    try:
        for rank in range(1, size):
            start(
                "--role", "member", "--name", f"m{rank}", "--rank", str(rank), "--port", str(port)
            )
        deadline = time.monotonic() + 600
        while len(rpc.members()) < size:
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {len(rpc.members())} of {size} members joined")
            time.sleep(0.1)
        proc = start(
            "--role", "joiner", "--rank", str(size), "--port", str(port), "--joins", str(joins)
        )
        out, _ = proc.communicate(timeout=600)
        result: dict[str, object] = json.loads(out.strip().splitlines()[-1])
        for info in rpc.members():
            if info.id != 0:
                rpc.rpc_async(info, leave_now)
        deadline = time.monotonic() + 300
        while len(rpc.members()) > 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        return result
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
            proc.wait()
        rpc.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--members", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--joins", type=int, default=5)
    parser.add_argument("--role", default="bench", choices=["bench", "member", "joiner"])
    parser.add_argument("--name", default="")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    if args.role == "member":
        member(args.name, args.rank, args.port)
        return
    if args.role == "joiner":
        joiner(args.rank, args.port, args.joins)
        return
    for size in args.members:
        result = measure(size, args.joins)
        times = sorted(float(t) * 1000 for t in result["times"])  # type: ignore[attr-defined]
        print(
            f"group of {size:3d}: join + reach all {result['members']} members: median "
            f"{statistics.median(times):7.1f} ms  (min {times[0]:.1f}, max {times[-1]:.1f}; "
            f"{len(times)} joins)",
            flush=True,
        )


if __name__ == "__main__":
    main()
