"""DistributedDataParallel combined with distributed RPC.

The shape of PyTorch's "Combining Distributed DataParallel with Distributed RPC Framework"
tutorial: a parameter server "ps" (rank 0, also the master) holds an embedding table behind a
``RemoteModule``; trainers "trainer1" ... "trainerN" each hold a replica of a dense layer wrapped
in ``DistributedDataParallel`` over a gloo group of the trainers. Each step runs the remote
embedding lookup, the DDP layer, ``dist_autograd.backward`` and a ``DistributedOptimizer`` over
both the server's parameters and the local ones. DDP's reducer averages the dense layer's
gradients across trainers inside the distributed autograd context.

The check: on the first step, every trainer's context gradient of the DDP layer must equal the
mean of the trainers' gradients computed in one process with plain autograd, and at the end the
trainers' replicas must be equal; the program exits with status 1 otherwise.

    python examples/ddp_rpc.py --trainers 2 --steps 20    # starts its own workers
"""

from __future__ import annotations

import argparse
import os
import socket
import sys

import torch
import torch.distributed as dist
from _local import spawn_workers  # examples/_local.py: start the workers locally
from torch import nn

import distgrad.autograd as dist_autograd
import distgrad.rpc as rpc
from distgrad.nn import RemoteModule
from distgrad.optim import DistributedOptimizer

TOLERANCE = 1e-5
ROWS, DIM, CLASSES, BAG = 100, 16, 4, 3


def make_dense(seed: int) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(DIM, CLASSES)


def make_embedding(seed: int) -> nn.EmbeddingBag:
    torch.manual_seed(seed + 1)
    return nn.EmbeddingBag(ROWS, DIM, mode="sum")


def batch(trainer: int, step: int, size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * trainer + step)
    indices = torch.randint(0, ROWS, (size * BAG,), generator=generator)
    offsets = torch.arange(0, size * BAG, BAG)
    target = torch.randint(0, CLASSES, (size,), generator=generator)
    return indices, offsets, target


def local_mean_gradient(args: argparse.Namespace, trainers: int) -> list[torch.Tensor]:
    """Step 1's dense-layer gradient, averaged over the trainers, in one process."""
    dense, embedding = make_dense(args.seed), make_embedding(args.seed)
    params = list(dense.parameters())
    total = [torch.zeros_like(p) for p in params]
    for trainer in range(1, trainers + 1):
        indices, offsets, target = batch(trainer, 1, args.batch_size)
        loss = nn.functional.cross_entropy(dense(embedding(indices, offsets)), target)
        grads = torch.autograd.grad(loss, params)
        total = [acc + grad for acc, grad in zip(total, grads, strict=True)]
    return [acc / trainers for acc in total]


def run_trainer(
    remote_embedding: RemoteModule, trainer: int, trainers: int, gloo: str, args: argparse.Namespace
) -> dict[str, float]:
    dist.init_process_group("gloo", init_method=gloo, rank=trainer - 1, world_size=trainers)
    try:
        model = nn.parallel.DistributedDataParallel(make_dense(args.seed))
        params = remote_embedding.remote_parameters() + [rpc.RRef(p) for p in model.parameters()]
        optimizer = DistributedOptimizer(torch.optim.SGD, params, lr=args.lr)
        result: dict[str, float] = {}
        for step in range(1, args.steps + 1):
            indices, offsets, target = batch(trainer, step, args.batch_size)
            with dist_autograd.context() as context_id:
                hidden = remote_embedding.forward(indices, offsets)
                loss = nn.functional.cross_entropy(model(hidden), target)
                dist_autograd.backward(context_id, [loss])
                if step == 1:
                    grads = dist_autograd.get_gradients(context_id)
                    expected = local_mean_gradient(args, trainers)
                    result["difference"] = max(
                        (grads[p] - want).abs().max().item()
                        for p, want in zip(model.parameters(), expected, strict=True)
                    )
                    dist.barrier()  # every trainer's step 1 saw the same server weights
                optimizer.step(context_id)
            result.setdefault("first_loss", loss.item())
            result["last_loss"] = loss.item()
            if step % args.log_every == 0:
                print(f"trainer{trainer} step {step:4d}  loss {loss.item():.4f}", flush=True)
        replica = torch.cat([p.detach().flatten() for p in model.parameters()])
        gathered = [torch.zeros_like(replica) for _ in range(trainers)]
        dist.all_gather(gathered, replica)
        result["replica_spread"] = max((g - replica).abs().max().item() for g in gathered)
        return result
    finally:
        dist.destroy_process_group()


def run_master(args: argparse.Namespace, trainers: int) -> bool:
    remote_embedding = RemoteModule("ps/cpu", make_embedding, args=(args.seed,))
    with socket.socket() as s:  # the trainers' gloo group meets here
        s.bind(("127.0.0.1", 0))
        gloo = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    futures = [
        rpc.rpc_async(f"trainer{t}", run_trainer, args=(remote_embedding, t, trainers, gloo, args))
        for t in range(1, trainers + 1)
    ]
    results = torch.futures.wait_all(futures)
    for t, result in enumerate(results, start=1):
        print(f"trainer{t}: loss {result['first_loss']:.4f} -> {result['last_loss']:.4f}")
    difference = max(result["difference"] for result in results)
    spread = max(result["replica_spread"] for result in results)
    ok = difference <= TOLERANCE and spread <= TOLERANCE
    print(f"DDP replicas after training: max spread {spread:.2e}")
    print(
        f"gradient check: max |distributed - local| = {difference:.2e} "
        f"(tolerance {TOLERANCE:g}): {'OK' if ok else 'FAILED'}",
        flush=True,
    )
    return ok


def worker(rank: int, world_size: int, init_method: str, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    options = rpc.TensorPipeRpcBackendOptions(init_method=init_method)
    name = "ps" if rank == 0 else f"trainer{rank}"
    rpc.init_rpc(name, rank=rank, world_size=world_size, rpc_backend_options=options)
    ok = True
    try:
        if rank == 0:
            ok = run_master(args, world_size - 1)
    finally:
        rpc.shutdown()
    if not ok:
        sys.exit(1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trainers", type=int, default=2, help="trainer processes (default 2)")
    parser.add_argument("--steps", type=int, default=20, help="steps per trainer (default 20)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=300, help="give up after (s)")
    args = parser.parse_args()
    if "RANK" in os.environ:  # started by `distgrad run -n N` or torchrun: one worker
        world_size = int(os.environ["WORLD_SIZE"])
        if world_size < 2:
            parser.error("needs at least 2 workers (the server and a trainer)")
        worker(int(os.environ["RANK"]), world_size, "env://", args)
        return 0
    if args.trainers < 1:
        parser.error("--trainers must be at least 1")
    return spawn_workers(worker, args.trainers + 1, args)


if __name__ == "__main__":
    sys.exit(main())
