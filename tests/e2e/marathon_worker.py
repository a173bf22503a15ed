"""A process of ``test_marathon.py``; run as a script inside a network namespace.

``python marathon_worker.py store PORT``: host the group's ``TCPStore`` (outside the members:
they run with ``TORCHELASTIC_USE_AGENT_STORE=True``); prints ``READY``.

``python marathon_worker.py member RANK STORE``: join the dynamic group as ``m<RANK>``; print
``JOINED``; serve until a ``leave`` line on stdin, then leave (graceful ``rpc.shutdown()``),
print ``LEFT <seconds>`` and exit.

``python marathon_worker.py trainer STORE``: rank 0 (``trainer``). Trains one ``RemoteModule``
on every other member, a step at a time, round after round: forward through the module and
an ``rpc_sync`` on that member inside a distributed autograd context, backward, a
``DistributedOptimizer`` step; the leaf's gradient is compared with single-process torch on a
local mirror of the module (updated as the optimizer updates the remote one). Prints one JSON
line per membership event (``EVENT``) and per failed step (``ERROR``: member, error, seconds
from the step's start to the error and to leaving the context). On a ``stop`` line on stdin:
checks that every member lists the same group and steps once more on each, prints
``RESULT {json}``; leaves at the next line.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any

import torch

import distgrad.autograd as dist_autograd
import distgrad.rpc as rpc
from distgrad.nn import RemoteModule
from distgrad.optim import DistributedOptimizer

LR = 0.005
FAILED_AT = [0.0]


def options(store: str) -> rpc.TensorPipeRpcBackendOptions:
    return rpc.TensorPipeRpcBackendOptions(
        init_method=f"tcp://{store}",
        rpc_timeout=20,  # heartbeat_interval and peer_timeout: the defaults (1 s, 4 s)
        num_worker_threads=8,
    )


_out = threading.Lock()


def say(line: str) -> None:
    """One whole line (the listener's thread and the main one both print)."""
    with _out:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def emit(tag: str, value: object) -> None:
    say(f"{tag} {json.dumps(value)}")


def members_seen() -> list[str]:
    """This member's view of the group (asked of it by RPC)."""
    return [w.name for w in rpc.members()]


def store_main(port: int) -> None:
    from torch.distributed import TCPStore

    store = TCPStore("0.0.0.0", port, is_master=True, wait_for_workers=False)
    print("READY", flush=True)
    sys.stdin.readline()  # until the test ends (it kills the process anyway)
    del store


def member_main(rank: int, store: str) -> None:
    rpc.init_rpc(f"m{rank}", rank=rank, world_size=None, rpc_backend_options=options(store))
    print("JOINED", flush=True)
    while sys.stdin.readline().strip() not in ("leave", ""):
        pass
    started = time.monotonic()
    rpc.shutdown()
    print(f"LEFT {time.monotonic() - started:.3f}", flush=True)


class Trained:
    """A RemoteModule on one member and its local mirror."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.module = RemoteModule(f"{name}/cpu", torch.nn.Linear, args=(4, 3))
        params = self.module.remote_parameters()
        self.optimizer = DistributedOptimizer(torch.optim.SGD, params, lr=LR)
        self.mirror = torch.nn.Linear(4, 3)
        with torch.no_grad():
            for mine, theirs in zip(self.mirror.parameters(), params, strict=True):
                mine.copy_(theirs.to_here())
        self.local_opt = torch.optim.SGD(self.mirror.parameters(), lr=LR)

    def step(self) -> bool:
        """One training step on the member; True if the leaf's gradient equals local torch's."""
        x = (0.5 * torch.randn(2, 4)).requires_grad_()
        target = torch.randn(2, 3)
        with dist_autograd.context() as context_id:
            try:
                y = self.module.forward(x)
                z = rpc.rpc_sync(self.name, torch.mul, args=(y, 2.0))
                dist_autograd.backward(context_id, [(z - target).pow(2).sum()])
                grad = dist_autograd.get_gradients(context_id)[x]
                self.optimizer.step(context_id)
            except BaseException:
                FAILED_AT[0] = time.monotonic()  # before leaving the context
                raise
        local = x.detach().clone().requires_grad_()
        self.local_opt.zero_grad()
        (self.mirror(local) * 2.0 - target).pow(2).sum().backward()
        self.local_opt.step()
        assert local.grad is not None
        return bool(torch.allclose(grad, local.grad, rtol=1e-5, atol=1e-6))


def trainer_main(store: str) -> None:
    rpc.init_rpc("trainer", rank=0, world_size=None, rpc_backend_options=options(store))
    rpc.add_membership_listener(lambda e: emit("EVENT", {"t": e.time, "event": str(e)}))
    say("JOINED")
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()), daemon=True).start()
    trained: dict[str, Trained] = {}
    counts = {"checks": 0, "wrong": 0, "errors": 0, "steps": 0}
    slowest = 0.0

    def step(name: str) -> bool:
        nonlocal slowest
        started = time.monotonic()
        wall = time.time()
        FAILED_AT[0] = 0.0
        try:
            if name not in trained:
                trained[name] = Trained(name)
            ok = trained[name].step()
        except Exception as error:
            reached = time.monotonic() - started
            failed_at = FAILED_AT[0] or time.monotonic()
            slowest = max(slowest, reached)
            trained.pop(name, None)
            counts["errors"] += 1
            emit(
                "ERROR",
                {
                    "t": wall,
                    "member": name,
                    "error": f"{type(error).__name__}: {error}"[:400],
                    "error_s": round(failed_at - started, 3),
                    "reached_s": round(reached, 3),
                },
            )
            return False
        took = time.monotonic() - started
        slowest = max(slowest, took)
        if took > 1.0:
            emit("SLOW", {"t": wall, "member": name, "s": round(took, 3)})
        counts["steps"] += 1
        counts["checks"] += 1
        counts["wrong"] += 0 if ok else 1
        return ok

    while not stop.is_set():
        names = [w.name for w in rpc.members() if w.id != 0]
        if not names:
            time.sleep(0.05)
        for name in names:
            step(name)
    views = {"trainer": members_seen()}
    final: dict[str, Any] = {}
    for name in views["trainer"][1:]:
        views[name] = rpc.rpc_sync(name, members_seen)
        final[name] = step(name)
    emit("RESULT", {**counts, "slowest_step_s": round(slowest, 3), "views": views, "final": final})
    sys.stdin.readline()  # "leave": once the members have left
    started = time.monotonic()
    rpc.shutdown()
    say(f"LEFT {time.monotonic() - started:.3f}")


if __name__ == "__main__":
    torch.manual_seed(os.getpid())
    role = sys.argv[1]
    if role == "store":
        store_main(int(sys.argv[2]))
    elif role == "member":
        member_main(int(sys.argv[2]), sys.argv[3])
    else:
        trainer_main(sys.argv[2])
