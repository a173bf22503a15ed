"""One worker of test_partition.py, inside a network-namespace host:
``partition_worker.py RANK MASTER_ADDR:PORT``. Rank 0 runs a distributed autograd step through
rank 1 (on the other host), prints ``READY``, then calls rank 1 until a call fails (the test cut
rank 1's host off) and again until one succeeds (the test healed it), runs the step again, has
rank 1 call back, and prints ``RESULT <json>``. Its times are ``time.monotonic()`` readings
(``*_at``): network namespaces share the machine's clock with the test.

The calls that wait for the cut have no timeout of their own: only failure detection can end
one (a timeout could otherwise pass for it)."""

from __future__ import annotations

import json
import sys
import time

import torch

import distgrad.autograd as dist_autograd
import distgrad.rpc as rpc


def stage(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ weight)


def name() -> str:
    return rpc.get_worker_info().name


def call(dst: str) -> str:
    return str(rpc.rpc_sync(dst, name, timeout=5))


def step_difference() -> float:
    torch.manual_seed(0)
    weight = torch.randn(6, 6, requires_grad=True)
    x = torch.randn(3, 6, requires_grad=True)
    with dist_autograd.context() as context_id:
        loss = rpc.rpc_sync("worker1", stage, (weight, x)).sum()
        dist_autograd.backward(context_id, [loss])
        grads = dist_autograd.get_gradients(context_id)
    local = [t.detach().clone().requires_grad_() for t in (weight, x)]
    expected = torch.autograd.grad(torch.tanh(local[1] @ local[0]).sum(), local)
    return max(
        (grads[t] - e).abs().max().item() for t, e in zip((weight, x), expected, strict=True)
    )


def main() -> None:
    rank = int(sys.argv[1])
    options = rpc.TensorPipeRpcBackendOptions(
        init_method=f"tcp://{sys.argv[2]}", heartbeat_interval=0.5, peer_timeout=2.0
    )
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2, rpc_backend_options=options)
    if rank == 0:
        result: dict[str, object] = {"before": step_difference()}
        print("READY", flush=True)
        started = time.monotonic()
        errors = []
        while time.monotonic() - started < 30 and not errors:  # until the cut shows
            try:
                rpc.rpc_sync("worker1", name, timeout=0)
                time.sleep(0.2)
            except RuntimeError as exc:
                errors.append(str(exc))
                result["first_error_at"] = time.monotonic()
        while time.monotonic() - started < 60:  # until it heals
            try:
                result["back"] = rpc.rpc_sync("worker1", name, timeout=3)
                break
            except RuntimeError as exc:
                errors.append(str(exc))
                time.sleep(0.2)
        result["back_at"] = time.monotonic()
        result["errors"] = errors[:3]
        result["after"] = step_difference()
        result["callback"] = rpc.rpc_sync("worker1", call, ("worker0",))
        result["dead"] = list(rpc._get_current_rpc_agent().statistics().dead_peers)
        print("RESULT " + json.dumps(result), flush=True)
    rpc.shutdown()


if __name__ == "__main__":
    main()
