"""A training script for a launcher: every worker runs this file.

    distgrad run -n 4 examples/train.py --epochs 3      # 4 local workers
    torchrun --nproc-per-node 4 examples/train.py       # the same, started by torchrun

The launcher sets ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``; ``init_rpc``
reads them (``init_method="env://"``, the default). Worker 0 is the trainer: it holds the data
and the model's first and last layers. Each other worker holds one hidden block of the model,
created there as a ``RemoteModule``. A training step runs the forward pass through every
worker in turn, ``dist_autograd.backward`` sends the gradients back along the same hops, and a
``DistributedOptimizer`` steps each worker's parameters where they live.

Before training, one step's gradients are compared with single-process torch autograd on the
same weights and batch; the program exits with status 1 if they differ. Copy this file as the
start of your own script.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from torch import nn

import distgrad.autograd as dist_autograd
import distgrad.rpc as rpc
from distgrad.nn import RemoteModule
from distgrad.optim import DistributedOptimizer

TOLERANCE = 1e-5
FEATURES, HIDDEN, CLASSES = 16, 32, 4


class Block(nn.Module):
    """One hidden block; its weights come from ``seed``. It travels by reference (module and
    name), so every worker must be able to import it: here they all run this file."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.linear = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x))


class Model(nn.Module):
    """The trainer's view of the model: local first and last layers, remote blocks between."""

    def __init__(self, blocks: list[nn.Module], seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.first = nn.Linear(FEATURES, HIDDEN)
        self.last = nn.Linear(HIDDEN, CLASSES)
        self.blocks = blocks  # RemoteModules (or local Blocks): not registered as submodules

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.first(x))
        for block in self.blocks:
            h = block(h)  # on a RemoteModule: runs on its worker, a distributed-autograd hop
        return self.last(h)  # type: ignore[no-any-return]


def make_data(batches: int, batch_size: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Synthetic classification: labels from a fixed random linear "teacher"."""
    gen = torch.Generator().manual_seed(seed)
    teacher = torch.randn(FEATURES, CLASSES, generator=gen)
    data = []
    for _ in range(batches):
        x = torch.randn(batch_size, FEATURES, generator=gen)
        data.append((x, (x @ teacher).argmax(dim=1)))
    return data


def gradient_check(
    model: Model, remote_blocks: list[RemoteModule], x: torch.Tensor, y: torch.Tensor
) -> float:
    """Max |difference| between one distributed step's gradients (read on each owner) and
    single-process autograd's on a local copy of the same weights."""
    with dist_autograd.context() as context_id:
        dist_autograd.backward(context_id, [nn.functional.cross_entropy(model(x), y)])
        grads = dist_autograd.get_gradients(context_id)
        distributed = [grads[p] for p in (*model.first.parameters(), *model.last.parameters())]
        for block in remote_blocks:
            rref = block.get_module_rref()
            distributed += rpc.rpc_sync(rref.owner(), _block_gradients, (rref, context_id))
    copies: list[nn.Module] = [block.get_module_rref().to_here() for block in remote_blocks]
    local = Model(copies, seed=0)
    local.load_state_dict(model.state_dict())
    nn.functional.cross_entropy(local(x), y).backward()
    expected = [p.grad for p in (*local.first.parameters(), *local.last.parameters())]
    expected += [p.grad for block in copies for p in block.parameters()]
    pairs = zip(distributed, expected, strict=True)
    return max(float((d - e).abs().max()) for d, e in pairs if e is not None)


def _block_gradients(block_rref: rpc.RRef[Block], context_id: int) -> list[torch.Tensor]:
    """On a block's owner: the gradients a context accumulated for the block."""
    grads = dist_autograd.get_gradients(context_id)
    return [grads[p] for p in block_rref.local_value().parameters()]


def train(args: argparse.Namespace, world_size: int) -> bool:
    remote_blocks = [
        RemoteModule(f"worker{rank}/cpu", Block, args=(args.seed + rank,))
        for rank in range(1, world_size)
    ]
    model = Model(list(remote_blocks), args.seed)
    params = [rpc.RRef(p) for p in model.parameters()]  # the first and last layers
    for block in remote_blocks:
        params += block.remote_parameters()
    optimizer = DistributedOptimizer(torch.optim.SGD, params, lr=args.lr, momentum=0.9)
    data = make_data(args.steps, args.batch_size, args.seed)

    owners = ", ".join(f"worker{rank}" for rank in range(1, world_size))
    print(f"model: {FEATURES} -> {HIDDEN} -> {CLASSES} with a hidden block on each of {owners}")
    difference = gradient_check(model, remote_blocks, *data[0])
    ok = difference <= TOLERANCE
    print(
        f"gradient check: max |distributed - local| = {difference:.2e} "
        f"(tolerance {TOLERANCE:g}): {'OK' if ok else 'FAILED'}",
        flush=True,
    )
    for epoch in range(1, args.epochs + 1):
        total = 0.0
        for x, y in data:
            with dist_autograd.context() as context_id:
                loss = nn.functional.cross_entropy(model(x), y)
                dist_autograd.backward(context_id, [loss])
                optimizer.step(context_id)
            total += loss.item()
        print(f"epoch {epoch}/{args.epochs}  loss {total / len(data):.4f}", flush=True)
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=5, help="passes over the data (default 5)")
    parser.add_argument("--steps", type=int, default=20, help="batches per epoch (default 20)")
    parser.add_argument("--batch-size", type=int, default=32, help="(default 32)")
    parser.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (default 0.05)")
    parser.add_argument("--seed", type=int, default=0, help="weights and data (default 0)")
    args = parser.parse_args()
    if "RANK" not in os.environ:
        parser.error(
            "start this script with a launcher, which sets RANK and WORLD_SIZE: "
            "distgrad run -n 4 examples/train.py (or torchrun --nproc-per-node 4 ...)"
        )
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world_size < 2:
        parser.error("needs at least 2 workers (the trainer and one hidden block): -n 2 or more")
    torch.set_num_threads(1)  # the workers share this machine's cores
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size)
    ok = True
    try:
        if rank == 0:
            ok = train(args, world_size)
    finally:
        rpc.shutdown()  # the other workers wait here, serving, until worker 0 is done
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
