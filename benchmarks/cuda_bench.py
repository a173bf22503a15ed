"""CUDA over RPC on one GPU, side by side with torch's RPC (TensorPipe), in one run.

Two processes share ``cuda:0`` (worker0 calls, worker1 answers), both with the map
``{cuda:0: cuda:0}``. Implementations, each in its own fresh group:

* ``torch``: TensorPipe with its default channels (``cuda_ipc`` between processes of one host);
* ``torch-basic``: TensorPipe restricted to ``cuda_basic`` (staging through pinned host
  memory, what distgrad does today);
* ``distgrad``.

Metrics (every call is followed by a synchronize of the caller's current stream, so each
figure is the time until the result is usable on the GPU):

* CUDA echo: ``rpc_sync("worker1", echo, (t,))`` for a CUDA tensor of 1 KiB ... 256 MiB;
  median round trip (ms) and GB/s (2 x size / time);
* small call with a CUDA argument: ``rpc_sync("worker1", add_one, (torch.ones(4, device=...),))``;
* MLP step on the GPU: ``Linear(512, 512) + ReLU`` on worker0, the same on worker1, a head on
  worker0; forward through ``rpc_sync``, distributed backward, gradients read (batch 256).

Ratios are distgrad / torch (time: lower is better for distgrad). Usage::

    python benchmarks/cuda_bench.py [--quick] [--json out.json]

Needs a CUDA device (exits 2 without one). ``scripts/gpu_check.sh`` runs it on a GPU machine.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (
    Placement,
    environment_info,
    format_size,
    median,
    print_table,
    run_group,
    write_json,
)

MAPS = ((0, {"worker1": {"cuda:0": "cuda:0"}}), (1, {"worker0": {"cuda:0": "cuda:0"}}))
HIDDEN = 512
_REMOTE: dict[str, Any] = {}


def echo(x: Any) -> Any:
    return x


def add_one(x: Any) -> Any:
    return x + 1


def remote_layer(x: Any) -> Any:
    import torch

    layer = _REMOTE.get("layer")
    if layer is None:
        torch.manual_seed(1)
        layer = _REMOTE["layer"] = torch.nn.Sequential(
            torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.ReLU()
        ).to(x.device)
    return layer(x)


def _timed(fn: Any, iters: int, warmup: int) -> list[float]:
    import torch

    sync = torch.cuda.current_stream().synchronize if torch.cuda.is_available() else _nothing
    for _ in range(warmup):
        fn()
    sync()
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync()
        samples.append(time.perf_counter() - t0)
    return samples


def _nothing() -> None:
    pass


def _dist_autograd(rpc: ModuleType) -> ModuleType:
    if rpc.__name__.startswith("torch"):
        import torch.distributed.autograd as torch_dist_autograd

        return torch_dist_autograd
    import distgrad.autograd as distgrad_dist_autograd

    return distgrad_dist_autograd


def caller(rpc: ModuleType, dst: str, cfg: dict[str, Any]) -> dict[str, Any]:
    import torch

    cuda = torch.device(cfg["device"])
    out: dict[str, Any] = {"echo": {}, "exact": True}
    for size in cfg["sizes"]:
        t = torch.randint(0, 255, (size,), dtype=torch.uint8, device=cuda)
        back = rpc.rpc_sync(dst, echo, (t,))
        out["exact"] = out["exact"] and bool(torch.equal(back, t)) and back.device == cuda
        iters = max(5, min(cfg["max_iters"], (cfg["bytes_per_size"] // size)))
        out["echo"][size] = _timed(lambda t=t: rpc.rpc_sync(dst, echo, (t,)), iters, 3)
    small = torch.ones(4, device=cuda)
    out["small"] = _timed(lambda: rpc.rpc_sync(dst, add_one, (small,)), cfg["small_iters"], 50)
    dist_autograd = _dist_autograd(rpc)
    torch.manual_seed(0)
    first = torch.nn.Sequential(torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.ReLU()).to(cuda)
    head = torch.nn.Linear(HIDDEN, 10).to(cuda)
    x = torch.randn(256, HIDDEN, device=cuda)
    target = torch.randint(0, 10, (256,), device=cuda)

    def step() -> None:
        with dist_autograd.context() as cid:
            h = rpc.rpc_sync(dst, remote_layer, (first(x),))
            loss = torch.nn.functional.cross_entropy(head(h), target)
            dist_autograd.backward(cid, [loss])
            dist_autograd.get_gradients(cid)

    out["mlp"] = _timed(step, cfg["mlp_iters"], 5)
    return out


IMPLS: dict[str, tuple[str, Placement]] = {
    "torch": ("torch", Placement(device_maps=MAPS)),
    "torch-basic": (
        "torch",
        Placement(device_maps=MAPS, torch_channels=("basic", "cuda_basic")),
    ),
    "distgrad": ("distgrad", Placement(device_maps=MAPS)),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer sizes and calls")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--impls", default=",".join(IMPLS), help="which to run (comma list)")
    parser.add_argument(
        "--cpu-smoke", action="store_true", help="run the script's logic on the CPU (no maps)"
    )
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available() and not args.cpu_smoke:
        print("cuda_bench: no CUDA device", file=sys.stderr)
        return 2
    impls = IMPLS
    if args.cpu_smoke:
        impls = {name: (impl, Placement()) for name, (impl, _) in IMPLS.items()}
        impls["torch-basic"] = ("torch", Placement())
    sizes = [1 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20, 256 << 20]
    cfg = {
        "sizes": [1 << 10, 1 << 20, 16 << 20, 64 << 20, 256 << 20] if args.quick else sizes,
        "bytes_per_size": (1 << 30) if args.quick else (4 << 30),
        "max_iters": 100 if args.quick else 500,
        "small_iters": 300 if args.quick else 2000,
        "mlp_iters": 20 if args.quick else 100,
        "device": "cpu" if args.cpu_smoke else "cuda:0",
    }
    if args.cpu_smoke:
        cfg.update(sizes=[1 << 10, 1 << 20], bytes_per_size=1 << 22, small_iters=50, mlp_iters=3)
    env = environment_info()
    env["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    print("environment:", env)
    results: dict[str, Any] = {}
    failed = False
    for name in args.impls.split(","):
        impl, placement = impls[name]
        started = time.monotonic()
        group = run_group(impl, caller, cfg, timeout=600, placement=placement)
        if not group.ok:
            failed = True
            print(
                f"{name}: FAILED ({group.phase}): {group.error}\n{group.log_tail}", file=sys.stderr
            )
            continue
        results[name] = group.value
        print(f"{name}: done in {time.monotonic() - started:.0f}s", flush=True)
        report(results, cfg, env, args.json)  # after each: a stopped run keeps what it measured
    exact = {n: v["exact"] for n, v in results.items()}
    return 1 if failed or not results or not all(exact.values()) else 0


def report(results: dict[str, Any], cfg: dict[str, Any], env: Any, json_path: str | None) -> None:
    """Print the table of what ran so far (and write it to ``json_path``)."""
    rows = []

    def add(label: str, key: Any, size: int | None = None) -> None:
        medians = {n: median(key(v)) for n, v in results.items()}
        row = [label]
        for n in IMPLS:
            ms = medians.get(n)
            text = "-" if ms is None else f"{ms * 1e3:.3f}"
            if ms is not None and size:
                text += f" ({2 * size / ms / 1e9:.1f} GB/s)"
            row.append(text)
        d = medians.get("distgrad")
        for n in ("torch", "torch-basic"):
            t = medians.get(n)
            row.append("-" if d is None or t is None else f"{d / t:.2f}x")
        rows.append(row)

    for size in cfg["sizes"]:
        add(f"CUDA echo {format_size(size)}", lambda v, s=size: v["echo"][s], size)
    add("small call, CUDA argument", lambda v: v["small"])
    add("MLP step on the GPU (batch 256)", lambda v: v["mlp"])
    headers = ["median ms", *IMPLS, "distgrad/torch", "distgrad/torch-basic"]
    print_table(headers, rows)
    exact = {n: v["exact"] for n, v in results.items()}
    print("echo bit-exact:", exact, flush=True)
    if json_path:
        write_json(json_path, {"environment": env, "config": cfg, "rows": rows, "raw": results})


if __name__ == "__main__":
    sys.exit(main())
