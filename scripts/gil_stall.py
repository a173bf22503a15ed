"""Measure what one worker's long GIL-holding C call does to its group (issue 14, item 8).

    python scripts/gil_stall.py                 # 3 workers, worker1 stalls 6 s
    python scripts/gil_stall.py --seconds 10 --peer-timeout 4
    python scripts/gil_stall.py --src /path/to/other/checkout/src   # another version
    python scripts/gil_stall.py --mode host     # every worker stopped (SIGSTOP) at once

Starts ``--workers`` real worker processes on this host (distgrad RPC over its usual sockets),
opens every connection in both directions, then has worker1 make one C call that holds the GIL
for ``--seconds``: ``usleep`` through ``ctypes.PyDLL`` (which keeps the GIL), exactly that long;
or with ``--mode pickle`` one ``pickle.dumps`` of a large list sized to take about that long
here (noisy on a loaded host). Its I/O thread cannot run meanwhile: no heartbeats, no reads.
Every worker keeps calling every other one (``rpc_sync`` with a 1 s timeout, every 0.25 s) from
before the stall until ``--after`` seconds after it, then makes one last call to each.
Printed per worker: when it suspected which peer and why (relative to the start of the
stall), how its probes fared, how its last calls ended, and its dead peers.

``--mode host`` stalls the whole host instead (a VM paused, an overloaded machine): every
worker is stopped with SIGSTOP for ``--seconds`` at the same moment, then continued.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing as mp
import os
import pickle
import secrets
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def _noop() -> None:
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _calibrated_list(seconds: float) -> list[list[int]]:
    """A list whose ``pickle.dumps`` takes about ``seconds`` here (one C call, GIL held)."""
    n = 1_000_000
    while True:
        started = time.monotonic()
        pickle.dumps([[1]] * n)
        took = time.monotonic() - started
        if took > 1.0 or n * 2 * seconds > 2e9:
            return [[1]] * int(n * seconds / max(took, 1e-3))
        n *= 2


def _worker(rank: int, args: argparse.Namespace, port: int, start_at: float, queue: Any) -> None:
    import distgrad.rpc as rpc

    world = args.workers
    options = rpc.TensorPipeRpcBackendOptions(
        init_method=f"tcp://127.0.0.1:{port}",
        peer_timeout=args.peer_timeout,
        heartbeat_interval=args.heartbeat_interval,
        rpc_timeout=30,
    )
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world, rpc_backend_options=options)
    from distgrad._rpc._core._layer import RpcLayer, register_layer

    agent = rpc._get_current_rpc_agent()

    deaths: list[tuple[float, int, str]] = []

    class _Deaths(RpcLayer):  # hears of every peer the agent gives up
        name = "gil_stall.deaths"

        def on_peer_failure(self, agent: Any, worker: int, error: Exception) -> None:
            deaths.append((time.monotonic(), worker, str(error)))

    register_layer(_Deaths())
    for dst in range(world):  # every connection, both directions
        rpc.rpc_sync(f"worker{dst}", _noop)
    big = _calibrated_list(args.seconds) if rank == 1 and args.mode == "pickle" else None
    ready_late = time.monotonic() > start_at
    time.sleep(max(0.0, start_at - time.monotonic()))
    stall: tuple[float, float] | None = None
    if big is not None:
        begin = time.monotonic()
        pickle.dumps(big)
        stall = (begin, time.monotonic())
        del big
    elif rank == 1 and args.mode == "gil":
        begin = time.monotonic()
        ctypes.PyDLL(None).usleep(int(args.seconds * 1e6))  # PyDLL: the GIL stays held
        stall = (begin, time.monotonic())
    elif args.mode == "host":  # the parent stops and continues every worker
        stall = (start_at, start_at + args.seconds)
    probes: dict[int, list[tuple[float, str]]] = {d: [] for d in range(world) if d != rank}
    stop = start_at + args.seconds + args.after
    while time.monotonic() < stop:
        for dst, outcomes in probes.items():
            t = time.monotonic()
            try:
                rpc.rpc_sync(f"worker{dst}", _noop, timeout=1.0)
                outcomes.append((t, "ok"))
            except Exception as exc:
                outcomes.append((t, f"{type(exc).__name__}: {exc}"[:140]))
        time.sleep(0.25)
    settled = time.monotonic()
    last = {}
    for dst in probes:
        try:
            rpc.rpc_sync(f"worker{dst}", _noop, timeout=5.0)
            last[dst] = "ok"
        except Exception as exc:
            last[dst] = f"{type(exc).__name__}: {exc}"[:140]
    dead = list(agent.statistics().dead_peers)
    deaths = [d for d in deaths if d[0] < settled]  # not the others' shutdowns
    time.sleep(max(0.0, stop + 6.0 - time.monotonic()))  # until every last call is done
    rpc.shutdown(graceful=False)
    queue.put(
        (rank, {"stall": stall, "deaths": deaths, "probes": probes, "last": last, "dead": dead,
                "ready_late": ready_late, "src": rpc.__file__})
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--mode", choices=["gil", "pickle", "host"], default="gil")
    parser.add_argument("--seconds", type=float, default=6.0, help="length of the stall")
    parser.add_argument("--after", type=float, default=8.0, help="probing after the stall (s)")
    parser.add_argument("--peer-timeout", type=float, default=4.0)
    parser.add_argument("--heartbeat-interval", type=float, default=1.0)
    parser.add_argument("--json", action="store_true", help="print the raw results as JSON")
    parser.add_argument("--src", default=str(REPO / "src"), help="the distgrad source to run")
    args = parser.parse_args()
    os.environ.setdefault("DISTGRAD_SECRET", secrets.token_hex(16))
    sys.path.insert(0, args.src)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    start_at = time.monotonic() + 15.0  # CLOCK_MONOTONIC is one clock for the whole host
    procs = [
        ctx.Process(target=_worker, args=(r, args, port, start_at, queue), daemon=True)
        for r in range(args.workers)
    ]
    for proc in procs:
        proc.start()
    if args.mode == "host":
        time.sleep(max(0.0, start_at - time.monotonic()))
        for proc in procs:
            os.kill(proc.pid, signal.SIGSTOP)  # type: ignore[arg-type]
        time.sleep(args.seconds)
        for proc in procs:
            os.kill(proc.pid, signal.SIGCONT)  # type: ignore[arg-type]
    results: dict[int, Any] = {}
    deadline = start_at + args.seconds + args.after + 70
    try:
        while len(results) < args.workers and time.monotonic() < deadline:
            try:
                rank, result = queue.get(timeout=1.0)
            except Exception:
                continue
            results[rank] = result
    finally:
        for proc in procs:
            proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join()
    if args.json:
        print(json.dumps(results, indent=1))
        return
    stall = results.get(1, {}).get("stall")
    if stall is None:
        print("worker1 reported nothing", results.keys())
        return
    t0 = stall[0]
    what = "(every worker) was stopped" if args.mode == "host" else "held the GIL"
    print(f"distgrad from {results[1]['src']}")
    print(
        f"worker1 {what} {stall[1] - stall[0]:.2f}s; peer_timeout {args.peer_timeout:g}s, "
        f"heartbeat {args.heartbeat_interval:g}s"
    )
    for rank in sorted(results):
        r = results[rank]
        print(f"\nworker{rank}{' (started late)' if r['ready_late'] else ''}:")
        for t, peer, why in r["deaths"]:
            print(f"  +{t - t0:6.2f}s  suspected worker{peer}: {why[:110]}")
        for dst, probes in sorted(r["probes"].items()):
            failed = [(t, outcome) for t, outcome in probes if outcome != "ok"]
            line = f"  probes to worker{dst}: {len(probes) - len(failed)} ok, {len(failed)} failed"
            if failed:
                line += f"; first failure +{failed[0][0] - t0:.2f}s: {failed[0][1][:90]}"
            healed = any(outcome == "ok" and t > stall[1] for t, outcome in probes)
            line += "; ok again after the stall" if healed else "; none ok after the stall"
            print(line)
        print(f"  last calls: {r['last']}; dead peers: {r['dead']}")


if __name__ == "__main__":
    main()
