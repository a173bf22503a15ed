"""Where a CUDA IPC transfer's time goes (GPU check, a few seconds): two processes on one
GPU, the steps distgrad's ``stage_shared`` / ``arrive_shared`` take, each timed alone over
many transfers (median µs), for a small and a large tensor.

Sender: device copy, ``reduce_tensor`` (IPC handle, ref counter, interprocess event),
``torch.cuda.ipc_collect()``. Receiver: ``rebuild_cuda_tensor`` (opening the handle and the
event), the copy out, and letting the shared tensor go (its deleter's stream sync and
counter update). Usage: ``python scripts/gpu_ipc_profile.py``.
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import sys
import time
from typing import Any

import torch
from torch.multiprocessing.reductions import reduce_tensor

ROUNDS = 60


def _us(samples: list[float]) -> str:
    return f"{statistics.median(samples) * 1e6:8.1f}"


def receiver(conn: Any) -> None:
    torch.cuda.init()
    quiet = torch.cuda.Stream(priority=-1)
    stream = torch.cuda.Stream()
    timing: dict[str, list[float]] = {"open": [], "copy": [], "release": [], "sync": []}
    while True:
        item = conn.recv()
        if item is None:
            break
        rebuild, args = item
        with torch.cuda.stream(stream):
            t0 = time.perf_counter()
            shared = rebuild(*args)
            t1 = time.perf_counter()
            out = torch.empty_like(shared)
            out.copy_(shared, non_blocking=True)
            t2 = time.perf_counter()
        stream.synchronize()
        t3 = time.perf_counter()
        with torch.cuda.stream(quiet):
            del shared
        t4 = time.perf_counter()
        for key, value in zip(timing, (t1 - t0, t2 - t1, t4 - t3, t3 - t2), strict=True):
            timing[key].append(value)
        conn.send(float(out[0]))
    conn.send({k: _us(v) for k, v in timing.items()})


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device")
        return 2
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=receiver, args=(child,), daemon=True)
    proc.start()
    stream = torch.cuda.Stream()
    for size in (1 << 10, 64 << 20):
        x = torch.ones(size // 4, device="cuda")
        timing: dict[str, list[float]] = {"copy": [], "share": [], "collect": [], "round": []}
        for i in range(ROUNDS):
            t0 = time.perf_counter()
            with torch.cuda.stream(stream):
                copy = torch.empty_like(x)
                copy.copy_(x, non_blocking=True)
                t1 = time.perf_counter()
                rebuild, args = reduce_tensor(copy)
                t2 = time.perf_counter()
            del copy
            if i % 2:
                torch.cuda.ipc_collect()
            t3 = time.perf_counter()
            parent.send((rebuild, args))
            assert parent.recv() == 1.0
            t4 = time.perf_counter()
            timing["copy"].append(t1 - t0)
            timing["share"].append(t2 - t1)
            if i % 2:
                timing["collect"].append(t3 - t2)
            timing["round"].append(t4 - t3)
        parent.send(None)
        theirs = parent.recv()
        print(
            f"{size:>10} B  sender µs: copy {_us(timing['copy'])} share {_us(timing['share'])} "
            f"collect {_us(timing['collect'])} | to receiver and back {_us(timing['round'])} | "
            f"receiver µs: open {theirs['open']} copy {theirs['copy']} sync {theirs['sync']} "
            f"release {theirs['release']}",
            flush=True,
        )
        if size != 64 << 20:
            proc.join(5)
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=receiver, args=(child,), daemon=True)
            proc.start()
    proc.join(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
