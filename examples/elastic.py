"""An elastic parameter server: trainers join mid-training, one leaves, one is killed.

Worker "ps" (rank 0) leads a *dynamic* group (``init_rpc(..., world_size=None)``) and holds a
linear model. Trainers are separate processes that join while training runs:

* trainer1 starts with the server; on its first step the gradient the server received is
  compared with single-process autograd (the program fails if they differ);
* trainer2 joins once trainer1 is in, trains a third of that time, and leaves with a graceful
  ``rpc.shutdown()``;
* trainer3 joins too, trains, and is killed (SIGKILL) -- the others go on.

Each trainer runs distributed autograd through the server (``rpc_sync("ps", forward, x)``,
``dist_autograd.backward``) and asks the server to apply the gradients of its context. The
server prints who joined and left when (a membership listener), and its validation loss, which
keeps falling whoever is training.

    python examples/elastic.py --seconds 12   # starts the server, which starts the trainers
"""

from __future__ import annotations

import argparse
import itertools
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import torch

import distgrad.autograd as dist_autograd
import distgrad.rpc as rpc

FEATURES = 8
LR = 0.003
TOLERANCE = 1e-5
_state: dict[str, torch.Tensor] = {}
_lock = threading.Lock()
_started = time.monotonic()


def stamp() -> str:
    return f"[{time.monotonic() - _started:5.1f}s]"


def true_weights() -> torch.Tensor:
    return torch.linspace(-1.0, 1.0, FEATURES).unsqueeze(1)


def batch(generator: torch.Generator, n: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(n, FEATURES, generator=generator)
    return x, x @ true_weights()


# -- on the server -------------------------------------------------------------------------------
def forward(x: torch.Tensor) -> torch.Tensor:
    with _lock:
        w = _state["w"]
    return x @ w


def apply_gradients(context_id: int) -> torch.Tensor:
    """SGD step with this context's gradient (the weights are replaced, never changed in
    place, so a pass of another trainer still running keeps the weights it saw)."""
    grads = list(dist_autograd.get_gradients(context_id).values())
    grad = torch.stack(grads).sum(0)
    with _lock:
        _state["w"] = (_state["w"] - LR * grad).detach().requires_grad_()
    return grad


def current_weights() -> torch.Tensor:
    with _lock:
        return _state["w"].detach().clone()


def validation_loss() -> float:
    x, y = batch(torch.Generator().manual_seed(1234), 256)
    return float(((x @ current_weights()) - y).pow(2).mean())


def server(port: int, seconds: float) -> int:
    torch.manual_seed(0)
    _state["w"] = torch.zeros(FEATURES, 1, requires_grad=True)
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}")
    rpc.init_rpc("ps", rank=0, world_size=None, rpc_backend_options=opts)
    rpc.add_membership_listener(lambda event: print(f"{stamp()} {event}", flush=True))
    print(f"{stamp()} ps leads the group; validation loss {validation_loss():.4f}", flush=True)
    losses = [validation_loss()]
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        procs["trainer1"] = start_trainer("trainer1", 1, port, seconds)
        wait_for(lambda: len(rpc.members()) >= 2, 60)
        procs["trainer2"] = start_trainer("trainer2", 2, port, seconds / 3)
        procs["trainer3"] = start_trainer("trainer3", 3, port, 10 * seconds)
        wait_for(lambda: "trainer3" in [w.name for w in rpc.members()], 60)
        losses.append(validation_loss())
        print(f"{stamp()} 3 trainers; validation loss {losses[-1]:.4f}", flush=True)
        time.sleep(seconds / 4)
        losses.append(validation_loss())
        print(f"{stamp()} killing trainer3 (SIGKILL); validation loss {losses[-1]:.4f}", flush=True)
        procs["trainer3"].send_signal(signal.SIGKILL)
        procs["trainer3"].wait(30)
        for name in ("trainer2", "trainer1"):
            code = procs[name].wait(120)
            losses.append(validation_loss())
            print(f"{stamp()} {name} finished (exit {code}); validation loss {losses[-1]:.4f}")
            if code != 0:
                return 1
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        rpc.shutdown()
    # (two readings may have no step between them: a trainer that had finished already)
    falling = all(b <= a for a, b in itertools.pairwise(losses)) and losses[-1] < losses[0] / 10
    print(f"validation loss {' -> '.join(f'{v:.4f}' for v in losses)}: "
          f"{'falling' if falling else 'NOT falling'}")  # fmt: skip
    return 0 if falling else 1


# -- on a trainer --------------------------------------------------------------------------------
def trainer(name: str, rank: int, port: int, seconds: float) -> int:
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}")
    rpc.init_rpc(name, rank=rank, world_size=None, rpc_backend_options=opts)
    generator = torch.Generator().manual_seed(rank)
    status = 0
    deadline = time.monotonic() + seconds
    step = 0
    while step == 0 or time.monotonic() < deadline:
        x, y = batch(generator)
        check = step == 0 and name == "trainer1"
        before = rpc.rpc_sync("ps", current_weights) if check else None
        with dist_autograd.context() as context_id:
            loss = (rpc.rpc_sync("ps", forward, args=(x,)) - y).pow(2).mean()
            dist_autograd.backward(context_id, [loss])
            grad = rpc.rpc_sync("ps", apply_gradients, args=(context_id,))
        if before is not None:
            w = before.clone().requires_grad_()
            ((x @ w) - y).pow(2).mean().backward()
            assert w.grad is not None
            diff = float((grad - w.grad).abs().max())
            ok = diff <= TOLERANCE
            print(f"{name}: gradient check: max |distributed - local| = {diff:.2e} "
                  f"(tolerance {TOLERANCE:g}): {'OK' if ok else 'FAILED'}", flush=True)  # fmt: skip
            status = 0 if ok else 1
        step += 1
        time.sleep(0.02)
    rpc.shutdown()  # leaves the group; the others go on
    return status


# -- plumbing ------------------------------------------------------------------------------------
def start_trainer(name: str, rank: int, port: int, seconds: float) -> subprocess.Popen[bytes]:
    args = ["--role", "trainer", "--name", name, "--rank", str(rank), "--port", str(port)]
    return subprocess.Popen([sys.executable, __file__, *args, "--seconds", str(seconds)])


def wait_for(condition: object, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise TimeoutError("the group did not reach the expected size in time")
        time.sleep(0.02)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--role", default="server", choices=["server", "trainer"])
    parser.add_argument("--name", default="ps")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument(
        "--seconds", type=float, default=12.0, help="how long trainer1 trains (after it joined)"
    )
    args = parser.parse_args()
    if args.role == "trainer":
        return trainer(args.name, args.rank, args.port, args.seconds)
    os.environ.pop("WORLD_SIZE", None)
    return server(args.port or free_port(), args.seconds)


if __name__ == "__main__":
    sys.exit(main())
