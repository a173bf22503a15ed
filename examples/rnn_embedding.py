"""A distributed RNN language model: the embedding table lives on another worker.

The shape of PyTorch's "Getting Started with Distributed RPC Framework" tutorial (its
distributed RNN part): worker "ps" holds the embedding table and the decoder (created there
with ``rpc.remote``), the trainer holds the LSTM. Each forward looks tokens up on "ps", runs the
LSTM locally and decodes on "ps"; ``dist_autograd.backward`` sends gradients to both workers
and a ``DistributedOptimizer`` updates the embedding and decoder on "ps" and the LSTM on the
trainer. With ``--sparse`` the embedding produces sparse gradients (``nn.Embedding(...,
sparse=True)``, stepped with SGD), as large tables usually do.

The "language" is synthetic: each sequence follows ``next = (a * token + b) % vocab`` with
occasional random tokens. The first step's gradients on both workers are compared with
single-process autograd on the same weights and batch; exit status 1 if they differ.

    python examples/rnn_embedding.py --steps 100 --sparse   # starts its own 2 workers
    distgrad run -n 2 examples/rnn_embedding.py             # or let distgrad run start them
"""

from __future__ import annotations

import argparse
import copy
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

WORLD_SIZE = 2
TOLERANCE = 1e-5
# rpc.remote() returns at once, so "ps" may build the embedding and the decoder on two RPC
# threads at the same time; seeding torch's global generator and drawing from it must not
# interleave, or the weights would depend on thread timing.
_init_lock = threading.Lock()


# -- the remote parts (created on "ps") ----------------------------------------------------------
class RemotePart(nn.Module):
    def parameter_rrefs(self) -> list[rpc.RRef[nn.Parameter]]:
        return [rpc.RRef(p) for p in self.parameters()]

    def gradients(self, context_id: int) -> list[torch.Tensor]:
        """This module's gradients in a distributed autograd context (dense or sparse)."""
        grads = dist_autograd.get_gradients(context_id)
        return [grads[p] for p in self.parameters()]

    def state(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.state_dict().items()}


class EmbeddingTable(RemotePart):
    def __init__(self, ntoken: int, ninp: int, sparse: bool, seed: int) -> None:
        super().__init__()
        with _init_lock:
            torch.manual_seed(seed)
            self.encoder = nn.Embedding(ntoken, ninp, sparse=sparse)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.encoder(tokens)  # type: ignore[no-any-return]


class Decoder(RemotePart):
    def __init__(self, ntoken: int, nhid: int, seed: int) -> None:
        super().__init__()
        with _init_lock:
            torch.manual_seed(seed)
            self.decoder = nn.Linear(nhid, ntoken)

    def forward(self, output: torch.Tensor) -> torch.Tensor:
        return self.decoder(output)  # type: ignore[no-any-return]


# -- the model, as the trainer sees it -------------------------------------------------------------
class RNNModel(nn.Module):
    def __init__(self, ps: str, args: argparse.Namespace) -> None:
        super().__init__()
        self.emb_table_rref = rpc.remote(
            ps, EmbeddingTable, args=(args.vocab, args.embed, args.sparse, args.seed)
        )
        torch.manual_seed(args.seed + 1)
        self.rnn = nn.LSTM(args.embed, args.hidden, args.layers)
        self.decoder_rref = rpc.remote(ps, Decoder, args=(args.vocab, args.hidden, args.seed + 2))

    def forward(
        self, tokens: torch.Tensor, hidden: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        emb = self.emb_table_rref.rpc_sync().forward(tokens)  # on "ps"
        output, hidden = self.rnn(emb, hidden)  # here
        return self.decoder_rref.rpc_sync().forward(output), hidden  # on "ps"

    def parameter_rrefs(self) -> list[rpc.RRef[nn.Parameter]]:
        return (
            self.emb_table_rref.rpc_sync().parameter_rrefs()
            + [rpc.RRef(p) for p in self.rnn.parameters()]
            + self.decoder_rref.rpc_sync().parameter_rrefs()
        )

    def init_hidden(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (self.rnn.num_layers, batch_size, self.rnn.hidden_size)
        return torch.zeros(shape), torch.zeros(shape)


def make_batches(args: argparse.Namespace) -> list[torch.Tensor]:
    """``steps`` batches of token sequences, shape (bptt + 1, batch): inputs are rows
    ``[:-1]``, targets rows ``[1:]``."""
    gen = torch.Generator().manual_seed(args.seed + 3)
    batches = []
    for _ in range(args.steps):
        seq = torch.empty(args.bptt + 1, args.batch_size, dtype=torch.long)
        seq[0] = torch.randint(0, args.vocab, (args.batch_size,), generator=gen)
        for t in range(1, args.bptt + 1):
            seq[t] = (7 * seq[t - 1] + 3) % args.vocab
            noise = torch.rand(args.batch_size, generator=gen) < 0.1
            seq[t][noise] = torch.randint(0, args.vocab, (int(noise.sum()),), generator=gen)
        batches.append(seq)
    return batches


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def dense(t: torch.Tensor) -> torch.Tensor:
    return t.to_dense() if t.is_sparse else t


def gradient_check(model: RNNModel, args: argparse.Namespace, seq: torch.Tensor) -> float:
    """One distributed step's gradients (embedding and decoder on "ps", LSTM here) against
    single-process autograd with the same initial weights and batch."""
    local_rnn = copy.deepcopy(model.rnn)  # before any step: the same weights
    with dist_autograd.context() as context_id:
        logits, _ = model(seq[:-1], model.init_hidden(args.batch_size))
        dist_autograd.backward(context_id, [lm_loss(logits, seq[1:])])
        mine = dist_autograd.get_gradients(context_id)
        distributed = model.emb_table_rref.rpc_sync().gradients(context_id)
        distributed += [mine[p] for p in model.rnn.parameters()]
        distributed += model.decoder_rref.rpc_sync().gradients(context_id)
    emb = EmbeddingTable(args.vocab, args.embed, args.sparse, args.seed)
    emb.load_state_dict(model.emb_table_rref.rpc_sync().state())
    dec = Decoder(args.vocab, args.hidden, args.seed + 2)
    dec.load_state_dict(model.decoder_rref.rpc_sync().state())
    output, _ = local_rnn(emb(seq[:-1]), model.init_hidden(args.batch_size))
    lm_loss(dec(output), seq[1:]).backward()
    local = [*emb.parameters(), *local_rnn.parameters(), *dec.parameters()]
    assert len(local) == len(distributed)
    if args.sparse:
        assert distributed[0].is_sparse, "expected a sparse embedding gradient"
    return max(
        float((dense(d) - dense(p.grad)).abs().max())
        for d, p in zip(distributed, local, strict=True)
        if p.grad is not None
    )


def run_trainer(args: argparse.Namespace) -> bool:
    model = RNNModel("ps", args)
    # SGD handles sparse gradients (Adam does not; torch.optim.SparseAdam does).
    optimizer = DistributedOptimizer(torch.optim.SGD, model.parameter_rrefs(), lr=args.lr)
    batches = make_batches(args)

    difference = gradient_check(model, args, batches[0])
    ok = difference <= TOLERANCE
    print(
        f"gradient check: max |distributed - local| = {difference:.2e} "
        f"(tolerance {TOLERANCE:g}, {'sparse' if args.sparse else 'dense'} embedding "
        f"gradients): {'OK' if ok else 'FAILED'}",
        flush=True,
    )
    hidden = model.init_hidden(args.batch_size)
    started = time.perf_counter()
    for step, seq in enumerate(batches, 1):
        hidden = (hidden[0].detach(), hidden[1].detach())  # truncated backprop through time
        with dist_autograd.context() as context_id:
            logits, hidden = model(seq[:-1], hidden)
            loss = lm_loss(logits, seq[1:])
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
    name = "trainer" if rank == 0 else "ps"
    rpc.init_rpc(name, rank=rank, world_size=world_size, rpc_backend_options=options)
    ok = True
    try:
        if rank == 0:
            ok = run_trainer(args)
    finally:
        rpc.shutdown()  # "ps" waits here, serving, until the trainer is done
    if not ok:
        sys.exit(1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="training steps (default 200)")
    parser.add_argument("--sparse", action="store_true", help="sparse embedding gradients")
    parser.add_argument("--vocab", type=int, default=50)
    parser.add_argument("--embed", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--bptt", type=int, default=12, help="sequence length per step")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=25)
    parser.add_argument("--timeout", type=float, default=300, help="give up after (s)")
    args = parser.parse_args()
    if "RANK" in os.environ:  # started by `distgrad run -n 2` or torchrun: one worker
        world_size = int(os.environ["WORLD_SIZE"])
        if world_size != WORLD_SIZE:
            parser.error(f"needs exactly {WORLD_SIZE} workers, got WORLD_SIZE={world_size}")
        worker(int(os.environ["RANK"]), world_size, "env://", args)
        return 0
    return spawn_workers(worker, WORLD_SIZE, args)


if __name__ == "__main__":
    sys.exit(main())
