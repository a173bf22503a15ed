"""Pipeline parallelism across 3 workers, with micro-batches in flight.

The shape of PyTorch's "Distributed Pipeline Parallelism Using RPC" tutorial: worker0 (the
master) holds the data and the loss; the model is cut into two shards, one on worker1 and one
on worker2. Each batch is split into micro-batches; for each, the master asks worker1 for
``shard1(x)`` (``remote``: the result stays on worker1 as an RRef) and worker2 for
``shard2(that RRef)`` (``rpc_async``), so all micro-batches are in flight at once and the two
shards work on different micro-batches at the same time. ``dist_autograd.backward`` sends the
gradients back along the same hops and a ``DistributedOptimizer`` updates each shard where it
lives.

Before training, one step's gradients are compared with single-process autograd on the same
weights and the same batch; the program exits with status 1 if they differ.

    python examples/pipeline.py --steps 20      # starts its own 3 local workers
    distgrad run -n 3 examples/pipeline.py      # or let distgrad run (or torchrun) start them
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

import torch
from _local import spawn_workers  # examples/_local.py: start the workers locally
from torch import nn

import distgrad.autograd as dist_autograd
import distgrad.rpc as rpc
from distgrad.optim import DistributedOptimizer

WORLD_SIZE = 3
TOLERANCE = 1e-5
IN_FEATURES, HIDDEN, CLASSES = 32, 64, 8


# -- the two shards (built on worker1 and worker2) -------------------------------------------------
class Shard(nn.Module):
    """One piece of the model. ``forward`` takes an RRef to its input (which may live on
    another worker) and fetches it with ``to_here()``."""

    def __init__(self, layers: nn.Module) -> None:
        super().__init__()
        self.layers = layers
        # Micro-batches arrive on several RPC threads at once; run one at a time, as the
        # tutorial does (a stage is one device: concurrency comes from the other stages).
        self._lock = threading.Lock()

    def forward(self, x_rref: rpc.RRef[torch.Tensor]) -> torch.Tensor:
        x = x_rref.to_here()
        with self._lock:
            return self.layers(x)  # type: ignore[no-any-return]

    def parameter_rrefs(self) -> list[rpc.RRef[nn.Parameter]]:
        return [rpc.RRef(p) for p in self.parameters()]

    def gradients(self, context_id: int) -> list[torch.Tensor]:
        """This shard's parameter gradients in a distributed autograd context."""
        grads = dist_autograd.get_gradients(context_id)
        return [grads[p] for p in self.parameters()]

    def state(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.layers.state_dict().items()}


def make_layers(seed: int) -> tuple[nn.Module, nn.Module]:
    """The whole model, as (first part, second part), from one seed."""
    torch.manual_seed(seed)
    first = nn.Sequential(nn.Linear(IN_FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN))
    second = nn.Sequential(
        nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, CLASSES)
    )
    return first, second


def make_shard(index: int, seed: int) -> Shard:
    return Shard(make_layers(seed)[index])


# -- the master (worker0) --------------------------------------------------------------------------
class DistNet(nn.Module):
    """The model as the master sees it: two remote shards and a micro-batch schedule."""

    def __init__(self, seed: int, micro_batches: int) -> None:
        super().__init__()
        self.micro_batches = micro_batches
        self.shard1 = rpc.remote("worker1", make_shard, args=(0, seed))
        self.shard2 = rpc.remote("worker2", make_shard, args=(1, seed))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        futures = []
        for xs in x.chunk(self.micro_batches):
            x_rref = rpc.RRef(xs)
            y_rref = self.shard1.remote().forward(x_rref)  # stays on worker1
            futures.append(self.shard2.rpc_async().forward(y_rref))  # worker2 pulls it
        return torch.cat(torch.futures.wait_all(futures))

    def parameter_rrefs(self) -> list[rpc.RRef[nn.Parameter]]:
        return self.shard1.rpc_sync().parameter_rrefs() + self.shard2.rpc_sync().parameter_rrefs()


def make_data(steps: int, batch_size: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Synthetic classification: labels from a fixed random linear "teacher"."""
    gen = torch.Generator().manual_seed(seed + 1)
    teacher = torch.randn(IN_FEATURES, CLASSES, generator=gen)
    batches = []
    for _ in range(steps):
        x = torch.randn(batch_size, IN_FEATURES, generator=gen)
        batches.append((x, (x @ teacher).argmax(dim=1)))
    return batches


def gradient_check(model: DistNet, x: torch.Tensor, y: torch.Tensor) -> float:
    """Max |difference| between one distributed step's gradients and local autograd's, on the
    shards' current weights and the same batch."""
    with dist_autograd.context() as context_id:
        loss = nn.functional.cross_entropy(model(x), y)
        dist_autograd.backward(context_id, [loss])
        distributed = model.shard1.rpc_sync().gradients(context_id)
        distributed += model.shard2.rpc_sync().gradients(context_id)
    first, second = make_layers(0)
    first.load_state_dict(model.shard1.rpc_sync().state())
    second.load_state_dict(model.shard2.rpc_sync().state())
    local = nn.Sequential(first, second)
    nn.functional.cross_entropy(local(x), y).backward()
    local_grads = [p.grad for p in local.parameters()]
    assert len(local_grads) == len(distributed)
    return max(float((d - g).abs().max()) for d, g in zip(distributed, local_grads, strict=True))


def run_master(args: argparse.Namespace) -> bool:
    model = DistNet(args.seed, args.micro_batches)
    optimizer = DistributedOptimizer(torch.optim.SGD, model.parameter_rrefs(), lr=args.lr)
    batches = make_data(args.steps, args.batch_size, args.seed)

    difference = gradient_check(model, *batches[0])
    ok = difference <= TOLERANCE
    print(
        f"gradient check: max |distributed - local| = {difference:.2e} "
        f"(tolerance {TOLERANCE:g}): {'OK' if ok else 'FAILED'}",
        flush=True,
    )
    started = time.perf_counter()
    for step, (x, y) in enumerate(batches, 1):
        with dist_autograd.context() as context_id:
            loss = nn.functional.cross_entropy(model(x), y)
            dist_autograd.backward(context_id, [loss])
            optimizer.step(context_id)
        if step == 1 or step % args.log_every == 0 or step == args.steps:
            print(f"step {step:4d}  loss {loss.item():.4f}", flush=True)
    elapsed = time.perf_counter() - started
    print(f"{args.steps} steps in {elapsed:.2f} s ({elapsed / args.steps * 1e3:.1f} ms per step)")
    return ok


# -- starting the workers ------------------------------------------------------------------------
def worker(rank: int, world_size: int, init_method: str, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    options = rpc.TensorPipeRpcBackendOptions(init_method=init_method)
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size, rpc_backend_options=options)
    ok = True
    try:
        if rank == 0:
            ok = run_master(args)
    finally:
        rpc.shutdown()  # the other workers wait here, serving, until the master is done
    if not ok:
        sys.exit(1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="training steps (default 200)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=20)
    parser.add_argument("--timeout", type=float, default=300, help="give up after (s)")
    args = parser.parse_args()
    if "RANK" in os.environ:  # started by `distgrad run -n 3` or torchrun: one worker
        world_size = int(os.environ["WORLD_SIZE"])
        if world_size != WORLD_SIZE:
            parser.error(f"needs exactly {WORLD_SIZE} workers, got WORLD_SIZE={world_size}")
        worker(int(os.environ["RANK"]), world_size, "env://", args)
        return 0
    return spawn_workers(worker, WORLD_SIZE, args)


if __name__ == "__main__":
    sys.exit(main())
