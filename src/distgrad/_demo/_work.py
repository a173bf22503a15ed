"""What the demo's workers run: the model, the data, and the functions they call on each other.

Two layouts of one model (an MLP classifying scikit-learn's bundled 8x8 digits):

* **pipeline** -- worker0 (the driver) holds the data; the model's layers are split into
  stages on workers 1..N-1. Each batch is cut into micro-batches that travel
  driver -> stage 1 -> stage 2 -> ... concurrently (``rpc_async``; each stage calls the next);
  ``dist_autograd.backward`` sends the gradients back along the same hops, and a
  ``DistributedOptimizer`` steps every stage's parameters where they live.
* **ps** (parameter server) -- worker0 holds the whole model; workers 1..N-1 are trainers, each
  with its shard of the data, training concurrently through a ``RemoteModule`` that shares the
  server's module, each with its own ``DistributedOptimizer``. They take turns on the shared
  model in a fixed round-robin order (``TurnOrder``), so a seed gives the same run every time.

Every module built here starts from the same seed, so a single-process copy of the model (the
gradient check) is bit-for-bit the model the workers train.
"""

from __future__ import annotations

import itertools
import threading
from typing import Any

import torch
from torch import nn

import distgrad.autograd as dist_autograd
import distgrad.rpc as rpc
from distgrad.nn import RemoteModule
from distgrad.optim import DistributedOptimizer

__all__ = [
    "LAYER_SIZES",
    "MAX_STAGES",
    "build_model",
    "describe_stages",
    "load_digits",
    "stage_bounds",
]

LAYER_SIZES = (64, 128, 96, 64, 10)
MAX_STAGES = len(LAYER_SIZES) - 1  # one Linear layer per stage at most
_state: dict[str, Any] = {}
_progress = {"steps": 0}
_progress_lock = threading.Lock()


class DemoDataError(RuntimeError):
    """The data set is not available (scikit-learn is missing)."""


def load_digits(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """scikit-learn's digits (1797 images, shipped inside the package: no download), scaled
    to [0, 1] and split 80/20 with a seeded permutation: ``(x_train, y_train, x_test, y_test)``."""
    try:
        from sklearn.datasets import load_digits as sklearn_digits
    except ImportError as exc:
        raise DemoDataError(
            "the demo trains on scikit-learn's bundled digits data set; install it with "
            "pip install 'distgrad[demo]' (or: pip install scikit-learn)"
        ) from exc
    digits = sklearn_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    cut = int(len(x) * 0.8)
    train, test = order[:cut], order[cut:]
    return x[train], y[train], x[test], y[test]


def build_model(seed: int) -> nn.Sequential:
    """The whole MLP, initialised from ``seed``."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for i, (n_in, n_out) in enumerate(itertools.pairwise(LAYER_SIZES)):
        layers.append(nn.Linear(n_in, n_out))
        if i < len(LAYER_SIZES) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def stage_bounds(num_stages: int) -> list[tuple[int, int]]:
    """Which slice of ``build_model``'s layers each stage holds (Linear layers spread evenly,
    each followed by its activation)."""
    linears = len(LAYER_SIZES) - 1
    starts = [round(i * linears / num_stages) for i in range(num_stages + 1)]
    # layer index of the k-th Linear is 2k; a stage ends before the next stage's first Linear
    total = 2 * linears - 1
    return [
        (2 * starts[i], 2 * starts[i + 1] if i + 1 < num_stages else total)
        for i in range(num_stages)
    ]


def describe_stages(names: list[str]) -> str:
    """Which layer sizes each stage worker holds, e.g. ``"worker1: 64 -> 128 -> 96, worker2:
    96 -> 64 -> 10"``."""
    bounds = stage_bounds(len(names))
    parts = []
    for name, (start, end) in zip(names, bounds, strict=True):
        first, last = start // 2, (end + 1) // 2  # Linear layers start..last-1 (each + ReLU)
        sizes = " -> ".join(map(str, LAYER_SIZES[first : last + 1]))
        parts.append(f"{name}: {sizes}")
    return ", ".join(parts)


def _params_as_rrefs(module: nn.Module) -> list[rpc.RRef[nn.Parameter]]:
    return [rpc.RRef(p) for p in module.parameters()]


# -- pipeline layout (stage workers) -------------------------------------------------------------
def setup_stage(index: int, num_stages: int, seed: int) -> list[rpc.RRef[nn.Parameter]]:
    """Build this worker's stage of the model; return RRefs to its parameters."""
    start, end = stage_bounds(num_stages)[index]
    stage = build_model(seed)[start:end]
    _state["stage"] = stage
    return _params_as_rrefs(stage)


def pipeline_forward(route: list[str], x: torch.Tensor) -> torch.Tensor:
    """Run this worker's stage, then hand the activations to the next stage on ``route``."""
    y: torch.Tensor = _state["stage"](x)
    if route:
        return rpc.rpc_sync(route[0], pipeline_forward, (route[1:], y))  # type: ignore[no-any-return]
    return y


def stage_gradients(context_id: int) -> list[torch.Tensor]:
    """This stage's parameter gradients in context ``context_id`` (module order)."""
    grads = dist_autograd.get_gradients(context_id)
    return [grads[p] for p in _state["stage"].parameters()]


def stage_state() -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in _state["stage"].state_dict().items()}


def pipeline_loss(
    route: list[str], x: torch.Tensor, y: torch.Tensor, micro_batches: int
) -> torch.Tensor:
    """The batch's mean cross-entropy, computed from micro-batches in flight together."""
    futures = [
        (rpc.rpc_async(route[0], pipeline_forward, (route[1:], xs)), ys)
        for xs, ys in zip(x.chunk(micro_batches), y.chunk(micro_batches), strict=True)
    ]
    total = torch.zeros(())
    for future, ys in futures:
        logits = future.wait()
        total = total + nn.functional.cross_entropy(logits, ys, reduction="sum")
    return total / len(x)


class PipelineTrainer:
    """The driver's side of the pipeline layout."""

    def __init__(self, stages: list[str], seed: int, lr: float, micro_batches: int) -> None:
        self.route = stages
        self.micro_batches = micro_batches
        param_rrefs: list[rpc.RRef[nn.Parameter]] = []
        futures = [
            rpc.rpc_async(name, setup_stage, (i, len(stages), seed))
            for i, name in enumerate(stages)
        ]
        for future in futures:
            param_rrefs.extend(future.wait())
        self.optimizer = DistributedOptimizer(torch.optim.SGD, param_rrefs, lr=lr, momentum=0.9)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        with dist_autograd.context() as context_id:
            loss = pipeline_loss(self.route, x, y, self.micro_batches)
            dist_autograd.backward(context_id, [loss])
            self.optimizer.step(context_id)
        return float(loss.detach())

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return rpc.rpc_sync(self.route[0], pipeline_forward, (self.route[1:], x))  # type: ignore[no-any-return]

    def gradient_check(self, x: torch.Tensor, y: torch.Tensor, seed: int) -> float:
        """Max |difference| between one distributed step's gradients and local autograd's."""
        with dist_autograd.context() as context_id:
            dist_autograd.backward(
                context_id, [pipeline_loss(self.route, x, y, self.micro_batches)]
            )
            remote = [
                g for s in self.route for g in rpc.rpc_sync(s, stage_gradients, (context_id,))
            ]
        local = build_model(seed)
        state: dict[str, torch.Tensor] = {}
        for name in self.route:  # a slice of a Sequential keeps the layers' indices as keys
            state.update(rpc.rpc_sync(name, stage_state))
        local.load_state_dict(state)
        torch.autograd.backward([nn.functional.cross_entropy(local(x), y)])
        return _max_difference(remote, [p.grad for p in local.parameters()])


# -- parameter-server layout ---------------------------------------------------------------------
def report_progress(steps: int) -> None:
    """Trainers tell the server (the driver) how many steps they did."""
    with _progress_lock:
        _progress["steps"] += steps


def progress_steps() -> int:
    with _progress_lock:
        return _progress["steps"]


def trainer_setup(
    module_rref: rpc.RRef[nn.Module], x: torch.Tensor, y: torch.Tensor, lr: float
) -> None:
    """A trainer: its shard of the data, a RemoteModule sharing the server's model, and a
    distributed optimizer over the server's parameters."""
    model = RemoteModule.init_from_module_rref("worker0/cpu", module_rref)
    _state["trainer"] = (model, x, y)
    _state["optimizer"] = DistributedOptimizer(
        torch.optim.SGD, model.remote_parameters(), lr=lr, momentum=0.9
    )


class TurnOrder:
    """The order in which trainers use the server's shared model.

    A step's forward pass saves weights that its backward pass needs, and another trainer's
    optimizer step would change them in place in between (autograd then refuses: "modified by
    an inplace operation"), so trainers take turns from forward to optimizer step. The turns go
    round robin in a fixed order (trainer by trainer, skipping those whose shard has no batch
    left), not first come first served: the same seed then gives the same numbers on every
    run, whichever trainer's message happens to arrive first.
    """

    #: A trainer that waits this long for its turn gives up (another one died or hung).
    WAIT_S = 300.0

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._order: list[str] = []
        self._next = 0

    def start_epoch(self, steps: dict[str, int]) -> None:
        """Set the turns of one epoch: ``steps`` maps each trainer to its number of batches."""
        order = [
            name for k in range(max(steps.values(), default=0)) for name in steps if k < steps[name]
        ]
        with self._cond:
            self._order, self._next = order, 0

    def take(self, name: str) -> None:
        with self._cond:
            if not self._cond.wait_for(
                lambda: self._next < len(self._order) and self._order[self._next] == name,
                timeout=self.WAIT_S,
            ):
                raise RuntimeError(f"{name} waited {self.WAIT_S:g} s for its turn")

    def end(self) -> None:
        with self._cond:
            self._next += 1
            self._cond.notify_all()


_turns = TurnOrder()


def start_epoch(steps: dict[str, int]) -> None:
    """On the server: the turns of the next epoch (see ``TurnOrder``)."""
    _turns.start_epoch(steps)


def take_turn(name: str) -> None:
    _turns.take(name)


def end_turn() -> None:
    _turns.end()


def shard_steps(shard_size: int, batch_size: int) -> int:
    return (shard_size + batch_size - 1) // batch_size


def trainer_epoch(batch_size: int, seed: int) -> float:
    """One pass over this trainer's shard; returns the mean loss."""
    model, x, y = _state["trainer"]
    optimizer: DistributedOptimizer = _state["optimizer"]
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    losses = []
    me = rpc.get_worker_info().name
    for batch in torch.split(order, batch_size):
        rpc.rpc_sync("worker0", take_turn, (me,))
        try:
            with dist_autograd.context() as context_id:
                loss = nn.functional.cross_entropy(model(x[batch]), y[batch])
                dist_autograd.backward(context_id, [loss])
                optimizer.step(context_id)
        finally:
            rpc.rpc_sync("worker0", end_turn)
        losses.append(float(loss.detach()))
        rpc.rpc_async("worker0", report_progress, (1,))
    return sum(losses) / len(losses)


def server_gradients(context_id: int) -> list[torch.Tensor]:
    grads = dist_autograd.get_gradients(context_id)
    return [grads[p] for p in _state["server"].parameters()]


def server_state() -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in _state["server"].state_dict().items()}


def trainer_gradient_check(x: torch.Tensor, y: torch.Tensor) -> float:
    """On a trainer: one distributed step's gradients (on the server) vs local autograd's."""
    model, _, _ = _state["trainer"]
    with dist_autograd.context() as context_id:
        loss = nn.functional.cross_entropy(model(x), y)
        dist_autograd.backward(context_id, [loss])
        remote = rpc.rpc_sync("worker0", server_gradients, (context_id,))
    local = build_model(0)
    local.load_state_dict(rpc.rpc_sync("worker0", server_state))
    torch.autograd.backward([nn.functional.cross_entropy(local(x), y)])
    return _max_difference(remote, [p.grad for p in local.parameters()])


def serve_model(seed: int) -> rpc.RRef[nn.Module]:
    """On the server (the driver): the model, and an RRef trainers share it through."""
    model = build_model(seed)
    _state["server"] = model
    return rpc.RRef(model)


def server_predict(x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return _state["server"](x)  # type: ignore[no-any-return]


def _max_difference(remote: list[torch.Tensor], local: list[torch.Tensor | None]) -> float:
    if len(remote) != len(local) or any(g is None for g in local):
        return float("inf")
    return max(
        float((r - g).abs().max()) for r, g in zip(remote, local, strict=True) if g is not None
    )
