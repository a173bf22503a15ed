"""The demo's driver (worker0): runs the training, shows progress, checks the gradients."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

import torch

import distgrad.rpc as rpc

from . import _work

__all__ = ["drive"]

_GRAD_TOLERANCE = 1e-5


class _Progress:
    """One line per epoch; on a terminal, a bar that fills as the epoch's steps complete."""

    def __init__(self, epochs: int, steps_per_epoch: int) -> None:
        self.epochs = epochs
        self.steps = steps_per_epoch
        self.live = sys.stdout.isatty()
        self._width = 30

    def update(self, epoch: int, done: int, loss: float | None) -> None:
        if not self.live:
            return
        filled = min(self._width, self._width * done // max(1, self.steps))
        bar = "#" * filled + "." * (self._width - filled)
        shown = f"  loss {loss:.3f}" if loss is not None else ""
        print(f"\r  epoch {epoch}/{self.epochs} [{bar}] {done}/{self.steps}{shown}", end="")
        sys.stdout.flush()

    def epoch_done(self, epoch: int, loss: float, accuracy: float, seconds: float) -> None:
        if self.live:
            print("\r" + " " * 79 + "\r", end="")
        print(
            f"  epoch {epoch}/{self.epochs}  loss {loss:.4f}  test accuracy {accuracy:6.2%}  "
            f"({seconds:.1f} s)",
            flush=True,
        )


def _accuracy(
    predict: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, y: torch.Tensor
) -> float:
    return float((predict(x).argmax(dim=1) == y).float().mean())


def drive(args: argparse.Namespace) -> bool:
    x_train, y_train, x_test, y_test = _work.load_digits(args.seed)
    others = [f"worker{r}" for r in range(1, args.workers)]
    print(
        f"  data: {len(x_train)} training / {len(x_test)} test images "
        f"(scikit-learn digits, 8x8; split with seed {args.seed})"
    )
    if args.layout == "pipeline":
        ok = _pipeline(args, others, x_train, y_train, x_test, y_test)
    else:
        ok = _parameter_server(args, others, x_train, y_train, x_test, y_test)
    return ok


def _report_check(difference: float, what: str) -> bool:
    ok = difference <= _GRAD_TOLERANCE
    verdict = "equal" if ok else "DIFFERENT"
    print(
        f"gradient check: {what} gradients {verdict} to single-process torch autograd's "
        f"(max |difference| {difference:.2e}, tolerance {_GRAD_TOLERANCE:g})"
    )
    return ok


def _pipeline(
    args: argparse.Namespace,
    stages: list[str],
    x_train: torch.Tensor,
    y_train: torch.Tensor,
    x_test: torch.Tensor,
    y_test: torch.Tensor,
) -> bool:
    print(
        f"  model {' -> '.join(map(str, _work.LAYER_SIZES))} split into {len(stages)} stages "
        f"({_work.describe_stages(stages)})"
    )
    print(
        f"  each batch of {args.batch_size} travels as {args.micro_batches} micro-batches "
        "in flight at once"
    )
    trainer = _work.PipelineTrainer(stages, args.seed, args.lr, args.micro_batches)
    batches = (len(x_train) + args.batch_size - 1) // args.batch_size
    progress = _Progress(args.epochs, batches)
    started = time.perf_counter()
    for epoch in range(1, args.epochs + 1):
        epoch_start = time.perf_counter()
        order = torch.randperm(len(x_train), generator=torch.Generator().manual_seed(epoch))
        losses = []
        for i, batch in enumerate(torch.split(order, args.batch_size)):
            losses.append(trainer.step(x_train[batch], y_train[batch]))
            progress.update(epoch, i + 1, sum(losses) / len(losses))
        accuracy = _accuracy(trainer.predict, x_test, y_test)
        progress.epoch_done(
            epoch, sum(losses) / len(losses), accuracy, time.perf_counter() - epoch_start
        )
    per_step = (time.perf_counter() - started) / (batches * args.epochs) * 1e3
    print(f"  {per_step:.1f} ms per training step (forward, distributed backward, optimizer)")
    difference = trainer.gradient_check(x_test[:64], y_test[:64], args.seed)
    return _report_check(difference, f"the {len(stages)} stages'")


def _parameter_server(
    args: argparse.Namespace,
    trainers: list[str],
    x_train: torch.Tensor,
    y_train: torch.Tensor,
    x_test: torch.Tensor,
    y_test: torch.Tensor,
) -> bool:
    print(
        f"  worker0 is the parameter server; {', '.join(trainers)} train on {len(trainers)} "
        "shards through RemoteModules sharing its model (taking turns from forward to "
        "optimizer step, round robin)"
    )
    module_rref = _work.serve_model(args.seed)
    shards = list(zip(x_train.chunk(len(trainers)), y_train.chunk(len(trainers)), strict=True))
    setups = [
        rpc.rpc_async(name, _work.trainer_setup, (module_rref, xs, ys, args.lr))
        for name, (xs, ys) in zip(trainers, shards, strict=True)
    ]
    for future in setups:
        future.wait()
    turns = {
        name: _work.shard_steps(len(xs), args.batch_size)
        for name, (xs, _) in zip(trainers, shards, strict=True)
    }
    steps = sum(turns.values())
    progress = _Progress(args.epochs, steps)
    started = time.perf_counter()
    for epoch in range(1, args.epochs + 1):
        epoch_start = time.perf_counter()
        base = _work.progress_steps()
        _work.start_epoch(turns)
        futures = [
            rpc.rpc_async(name, _work.trainer_epoch, (args.batch_size, args.seed * 1000 + epoch))
            for name in trainers
        ]
        finished = torch.futures.collect_all(futures)
        while not finished.done():
            time.sleep(0.1)
            progress.update(epoch, _work.progress_steps() - base, None)
        loss = sum(f.wait() for f in futures) / len(futures)
        accuracy = _accuracy(_work.server_predict, x_test, y_test)
        progress.epoch_done(epoch, loss, accuracy, time.perf_counter() - epoch_start)
    per_step = (time.perf_counter() - started) / (steps * args.epochs) * 1e3
    print(f"  {per_step:.1f} ms per training step across {len(trainers)} trainers")
    difference = rpc.rpc_sync(trainers[0], _work.trainer_gradient_check, (x_test[:64], y_test[:64]))
    return _report_check(difference, "the parameter server's")
