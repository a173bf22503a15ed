"""A parameter server with several trainers.

The shape of PyTorch's "Implementing a Parameter Server Using Distributed RPC Framework"
tutorial: worker "ps" (rank 0) holds the model; trainers "trainer1" ... "trainerN" each train
on their own data through an RRef to the server (``ps_rref.rpc_sync().forward(x)``), run
``dist_autograd.backward``, and step a ``DistributedOptimizer`` over RRefs to the server's
parameters.

The trainers share one set of weights, so they take turns from forward to optimizer step: a
step's forward saves weights its backward needs, and another trainer's optimizer step changing
them in between makes autograd refuse ("modified by an inplace operation"). The turn is a FIFO
lock on the server taken over RPC with ``@rpc.functions.async_execution``, so a waiting
trainer holds no server thread.

On trainer1's first step, the gradients on the server are compared with single-process
autograd on the same weights and batch; the program exits with status 1 if they differ.

    python examples/parameter_server.py --trainers 2 --steps 50   # starts its own workers
    distgrad run -n 3 examples/parameter_server.py                # or: ps + 2 trainers
"""

from __future__ import annotations

import argparse
import collections
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

TOLERANCE = 1e-5
IN_FEATURES, HIDDEN, CLASSES = 20, 64, 5


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(IN_FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
        nn.Linear(HIDDEN, CLASSES),
    )  # fmt: skip


# -- the parameter server ------------------------------------------------------------------------
class Turns:
    """A FIFO lock taken over RPC: ``acquire`` returns a Future that completes when it is the
    caller's turn, so a waiting trainer blocks no thread on the server."""

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._held = False
        self._waiting: collections.deque[torch.futures.Future[None]] = collections.deque()

    def acquire(self) -> torch.futures.Future[None]:
        future: torch.futures.Future[None] = torch.futures.Future()
        with self._mutex:
            if self._held:
                self._waiting.append(future)
                return future
            self._held = True
        future.set_result(None)
        return future

    def release(self) -> None:
        with self._mutex:
            if not self._waiting:
                self._held = False
                return
            successor = self._waiting.popleft()
        successor.set_result(None)


class ParameterServer(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        self.model = make_model(seed)
        self.turns = Turns()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)  # type: ignore[no-any-return]

    @rpc.functions.async_execution
    def take_turn(self) -> torch.futures.Future[None]:
        return self.turns.acquire()

    def end_turn(self) -> None:
        self.turns.release()

    def parameter_rrefs(self) -> list[rpc.RRef[nn.Parameter]]:
        return [rpc.RRef(p) for p in self.model.parameters()]

    def gradients(self, context_id: int) -> list[torch.Tensor]:
        """The gradients a distributed autograd context accumulated for the model."""
        grads = dist_autograd.get_gradients(context_id)
        return [grads[p] for p in self.model.parameters()]

    def state(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.model.state_dict().items()}


# -- a trainer -----------------------------------------------------------------------------------
class TrainerNet(nn.Module):
    """The model as a trainer sees it: every forward runs on the parameter server."""

    def __init__(self, ps_rref: rpc.RRef[ParameterServer]) -> None:
        super().__init__()
        self.ps_rref = ps_rref

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ps_rref.rpc_sync().forward(x)  # type: ignore[no-any-return]


def make_data(rank: int, steps: int, batch_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This trainer's batches: labels from a fixed random "teacher" shared by all trainers."""
    teacher = torch.randn(IN_FEATURES, CLASSES, generator=torch.Generator().manual_seed(1234))
    gen = torch.Generator().manual_seed(rank)
    batches = []
    for _ in range(steps):
        x = torch.randn(batch_size, IN_FEATURES, generator=gen)
        batches.append((x, (x @ teacher).argmax(dim=1)))
    return batches


def gradient_check(
    ps_rref: rpc.RRef[ParameterServer], context_id: int, x: torch.Tensor, y: torch.Tensor
) -> float:
    """After backward in ``context_id``: max |difference| between the server's gradients and
    single-process autograd's on the server's current weights and the same batch."""
    distributed = ps_rref.rpc_sync().gradients(context_id)
    local = make_model(0)
    local.load_state_dict(ps_rref.rpc_sync().state())
    nn.functional.cross_entropy(local(x), y).backward()
    return max(
        float((d - p.grad).abs().max())
        for d, p in zip(distributed, local.parameters(), strict=True)
        if p.grad is not None
    )


def run_trainer(ps_rref: rpc.RRef[ParameterServer], args: argparse.Namespace) -> dict[str, float]:
    """A trainer's loop (called by the server); returns its first and last loss and, on
    trainer1, the gradient check's difference."""
    me = rpc.get_worker_info()
    model = TrainerNet(ps_rref)
    optimizer = DistributedOptimizer(
        torch.optim.SGD, ps_rref.rpc_sync().parameter_rrefs(), lr=args.lr, momentum=0.9
    )
    result: dict[str, float] = {}
    for step, (x, y) in enumerate(make_data(me.id, args.steps, args.batch_size), 1):
        ps_rref.rpc_sync().take_turn()
        try:
            with dist_autograd.context() as context_id:
                loss = nn.functional.cross_entropy(model(x), y)
                dist_autograd.backward(context_id, [loss])
                if step == 1 and me.id == 1:
                    result["difference"] = gradient_check(ps_rref, context_id, x, y)
                optimizer.step(context_id)
        finally:
            ps_rref.rpc_sync().end_turn()
        result.setdefault("first_loss", loss.item())
        result["last_loss"] = loss.item()
        if step % args.log_every == 0:
            print(f"{me.name} step {step:4d}  loss {loss.item():.4f}", flush=True)
    return result


def run_server(args: argparse.Namespace, trainers: list[str]) -> bool:
    ps_rref = rpc.RRef(ParameterServer(args.seed))
    started = time.perf_counter()
    futures = [rpc.rpc_async(name, run_trainer, args=(ps_rref, args)) for name in trainers]
    results = torch.futures.wait_all(futures)
    elapsed = time.perf_counter() - started
    for name, result in zip(trainers, results, strict=True):
        print(f"{name}: loss {result['first_loss']:.4f} -> {result['last_loss']:.4f}")
    steps = args.steps * len(trainers)
    print(f"{steps} steps in {elapsed:.2f} s ({elapsed / steps * 1e3:.1f} ms per step)")
    difference = results[0]["difference"]
    ok = difference <= TOLERANCE
    print(
        f"gradient check: max |distributed - local| = {difference:.2e} "
        f"(tolerance {TOLERANCE:g}): {'OK' if ok else 'FAILED'}",
        flush=True,
    )
    return ok


# -- starting the workers ------------------------------------------------------------------------
def worker(rank: int, world_size: int, init_method: str, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    options = rpc.TensorPipeRpcBackendOptions(init_method=init_method)
    name = "ps" if rank == 0 else f"trainer{rank}"
    rpc.init_rpc(name, rank=rank, world_size=world_size, rpc_backend_options=options)
    ok = True
    try:
        if rank == 0:
            ok = run_server(args, [f"trainer{r}" for r in range(1, world_size)])
    finally:
        rpc.shutdown()  # the trainers wait here, serving, until the server is done
    if not ok:
        sys.exit(1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trainers", type=int, default=2, help="trainer processes (default 2)")
    parser.add_argument("--steps", type=int, default=100, help="steps per trainer (default 100)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=25)
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
