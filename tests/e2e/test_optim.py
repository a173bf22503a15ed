"""DistributedOptimizer end to end: parameter-server training on real workers, checked against
the same training in one process with plain torch autograd and the same optimizer."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import distgrad.autograd as dist_autograd
import distgrad.rpc as rpc
from distgrad.nn import RemoteModule
from distgrad.optim import DistributedOptimizer
from tests._harness import run_workers

pytestmark = pytest.mark.timeout(120)

STEPS = 5


# -- what the parameter servers run ------------------------------------------------------------
def make_linear(weight: torch.Tensor, bias: torch.Tensor) -> nn.Linear:
    """A Linear with the given initial parameters (so the local replica can start equal)."""
    layer = nn.Linear(weight.shape[1], weight.shape[0])
    with torch.no_grad():
        layer.weight.copy_(weight)
        layer.bias.copy_(bias)
    return layer


def make_param(value: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(value.clone())


def scale_by(param_rref: rpc.RRef[nn.Parameter], h: torch.Tensor) -> torch.Tensor:
    return h * param_rref.local_value()


def grad_of(rref: rpc.RRef[nn.Parameter]) -> torch.Tensor | None:
    return rref.local_value().grad


def fetch_all(rrefs: list[rpc.RRef[Any]]) -> list[torch.Tensor]:
    return [r.to_here().detach().clone() for r in rrefs]


class DecayingMomentum(torch.optim.Optimizer):
    """A custom optimizer with per-parameter state: momentum and a step-dependent rate."""

    def __init__(self, params: Any, lr: float = 0.1, beta: float = 0.5) -> None:
        super().__init__(params, {"lr": lr, "beta": beta})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                state["n"] = state.get("n", 0) + 1
                buf = state.setdefault("buf", torch.zeros_like(p))
                buf.mul_(group["beta"]).add_(p.grad)
                p.add_(buf, alpha=-group["lr"] / state["n"])


class FailingOnCreate(torch.optim.Optimizer):
    def __init__(self, params: Any, **kwargs: Any) -> None:
        raise ValueError(f"Error creating optimizer. ({rpc.get_worker_info().name})")


class FailingOnStep(torch.optim.SGD):
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        raise ValueError(f"Error running optimizer. ({rpc.get_worker_info().name})")


OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "sgd": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.01}),
    "adam": (torch.optim.Adam, {"lr": 0.01, "betas": (0.8, 0.9)}),
    "custom": (DecayingMomentum, {"lr": 0.1, "beta": 0.5}),
}


# -- the model: two parameter servers and a local layer ----------------------------------------
def initial_state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w1": torch.randn(8, 4, generator=g) * 0.5,
        "b1": torch.randn(8, generator=g) * 0.1,
        "w2": torch.randn(8, 8, generator=g) * 0.3,
        "b2": torch.randn(8, generator=g) * 0.1,
        "scale": torch.rand(8, generator=g) + 0.5,
        "w3": torch.randn(1, 8, generator=g) * 0.3,
        "b3": torch.zeros(1),
    }


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(16, 4, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin()


def forward(
    layer1: Callable[[torch.Tensor], torch.Tensor],
    layer2: Callable[[torch.Tensor], torch.Tensor],
    scale: Callable[[torch.Tensor], torch.Tensor],
    head: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
) -> torch.Tensor:
    h = torch.tanh(layer1(x))
    h = scale(torch.relu(layer2(h)))
    return nn.functional.mse_loss(head(h), y)


def local_training(
    seed: int,
    optim_cls: type[torch.optim.Optimizer],
    kwargs: dict[str, Any],
    schedule: list[int],
) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """The oracle: the same run in one process. ``schedule[k]`` is the trainer of step k (each
    trainer has its own head layer and head optimizer; the servers' optimizer is shared)."""
    s = initial_state(seed)
    layer1 = make_linear(s["w1"], s["b1"])
    layer2 = make_linear(s["w2"], s["b2"])
    scale = make_param(s["scale"])
    heads = {t: make_linear(s["w3"], s["b3"]) for t in set(schedule)}
    shared = optim_cls([*layer1.parameters(), *layer2.parameters(), scale], **kwargs)
    head_opts = {t: optim_cls(list(h.parameters()), **kwargs) for t, h in heads.items()}
    for step, trainer in enumerate(schedule):
        x, y = batch(step)
        loss = forward(layer1, layer2, lambda h: h * scale, heads[trainer], x, y)
        for p in [*layer1.parameters(), *layer2.parameters(), scale]:
            p.grad = None
        for p in heads[trainer].parameters():
            p.grad = None
        loss.backward()
        shared.step()
        head_opts[trainer].step()
    server = [t.detach().clone() for t in [*layer1.parameters(), *layer2.parameters(), scale]]
    return server, [[p.detach().clone() for p in heads[t].parameters()] for t in sorted(heads)]


class Trainer:
    """A trainer's handles on the servers (picklable through RPC: RemoteModules, RRefs)."""

    def __init__(self, seed: int) -> None:
        s = initial_state(seed)
        self.layer1 = RemoteModule("worker1/cpu", make_linear, (s["w1"], s["b1"]))
        self.layer2 = RemoteModule(
            "rank:2", make_linear, kwargs={"weight": s["w2"], "bias": s["b2"]}
        )
        self.scale = rpc.remote("worker2", make_param, (s["scale"],))

    def server_params(self) -> list[rpc.RRef[Any]]:
        return [*self.layer1.remote_parameters(), *self.layer2.remote_parameters(), self.scale]

    def loss(self, head: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        scale = self.scale

        def scaled(h: torch.Tensor) -> torch.Tensor:
            return rpc.rpc_sync(scale.owner(), scale_by, (scale, h))  # type: ignore[no-any-return]

        return forward(self.layer1, self.layer2.forward, scaled, head, x, y)


def train_steps(
    trainer: Trainer,
    head: nn.Module,
    shared: DistributedOptimizer,
    head_opt: DistributedOptimizer,
    steps: list[int],
) -> list[float]:
    losses = []
    for step in steps:
        x, y = batch(step)
        with dist_autograd.context() as cid:
            loss = trainer.loss(head, x, y)
            dist_autograd.backward(cid, [loss])
            shared.step(cid)
            head_opt.step(cid)
        losses.append(loss.item())
    return losses


# -- one trainer: exact parity for SGD, Adam and a custom optimizer ----------------------------
def single_trainer_program(rank: int, world_size: int) -> str:
    if rank != 0:
        return "served"
    for name, (optim_cls, kwargs) in OPTIMIZERS.items():
        trainer = Trainer(seed=7)
        head = make_linear(initial_state(7)["w3"], initial_state(7)["b3"])
        params = trainer.server_params()
        shared = DistributedOptimizer(optim_cls, params, **kwargs)
        head_opt = DistributedOptimizer(
            optim_cls, [rpc.RRef(p) for p in head.parameters()], **kwargs
        )
        assert [r.owner_name() for r in shared.remote_optimizers] == ["worker1", "worker2"]
        assert [r.owner_name() for r in head_opt.remote_optimizers] == ["worker0"]
        train_steps(trainer, head, shared, head_opt, list(range(STEPS)))
        want_server, (want_head,) = local_training(7, optim_cls, kwargs, [0] * STEPS)
        try:
            torch.testing.assert_close(fetch_all(params), want_server)
            torch.testing.assert_close([p.detach() for p in head.parameters()], want_head)
        except AssertionError as exc:
            raise AssertionError(f"{name}: {exc}") from exc
    return "ok"


def test_parameter_server_matches_local_training() -> None:
    """One trainer, two parameter servers (RemoteModules and a parameter RRef) and a local
    layer: after 5 steps, SGD (momentum, weight decay), Adam and a custom optimizer with state
    leave exactly the parameters of the same run in one process."""
    results = run_workers(single_trainer_program, 3, timeout=90)
    assert results[0] == "ok"


# -- two trainers: in turns (exact parity), then concurrently ----------------------------------
_shared: dict[str, Any] = {}


def receive(trainer: Trainer, shared: DistributedOptimizer) -> None:
    _shared["trainer"], _shared["opt"] = trainer, shared


def two_trainers_program(rank: int, world_size: int) -> Any:
    trainers = ["worker0", "worker3"]
    me = rpc.get_worker_info().name
    if me not in trainers:
        return "served"
    optim_cls, kwargs = OPTIMIZERS["sgd"]
    if rank == 0:  # builds the model and the shared optimizer, and hands both to worker3
        trainer = Trainer(seed=3)
        shared = DistributedOptimizer(optim_cls, trainer.server_params(), **kwargs)
        rpc.rpc_sync("worker3", receive, (trainer, shared))
    rpc.api._barrier(trainers)
    trainer, shared = (trainer, shared) if rank == 0 else (_shared["trainer"], _shared["opt"])
    head = make_linear(initial_state(3)["w3"], initial_state(3)["b3"])
    head_opt = DistributedOptimizer(optim_cls, [rpc.RRef(p) for p in head.parameters()], **kwargs)
    turn = trainers.index(me)
    # phase 1: the trainers take turns (a barrier between steps), so the order is known
    for step in range(2 * STEPS):
        if step % 2 == turn:
            train_steps(trainer, head, shared, head_opt, [step])
        rpc.api._barrier(trainers)
    server = fetch_all(trainer.server_params())
    mine = [p.detach().clone() for p in head.parameters()]
    # phase 2: both train at once (each on its own replicas on the same servers: steps change
    # parameters in place, so a forward sharing them with the other's step could not be
    # differentiated -- torch's "modified by an inplace operation", as in the reference)
    own = Trainer(seed=5 + turn)
    own_opt = DistributedOptimizer(optim_cls, own.server_params(), **kwargs)
    started = time.monotonic()
    losses = train_steps(own, head, own_opt, head_opt, [100 + turn] * 30)
    elapsed = time.monotonic() - started
    rpc.api._barrier(trainers)
    return {"server": server, "head": mine, "losses": losses, "elapsed": elapsed}


def test_two_trainers_share_servers_and_optimizer() -> None:
    """Two trainers share RemoteModules, a parameter RRef and one DistributedOptimizer (sent to
    the second through RPC): taking turns, the parameters equal the single-process run step for
    step; training at once on the same servers, neither deadlocks and both losses go down."""
    results = run_workers(two_trainers_program, 4, timeout=120)
    schedule = [k % 2 for k in range(2 * STEPS)]
    optim_cls, kwargs = OPTIMIZERS["sgd"]
    want_server, want_heads = local_training(3, optim_cls, kwargs, schedule)
    for rank, want_head in zip((0, 3), want_heads, strict=True):
        torch.testing.assert_close(results[rank]["server"], want_server)
        torch.testing.assert_close(results[rank]["head"], want_head)
        losses = results[rank]["losses"]
        assert losses[-1] < 0.5 * losses[0], losses
        assert results[rank]["elapsed"] < 60


# -- errors --------------------------------------------------------------------------------------
def errors_program(rank: int, world_size: int) -> str:
    if rank != 0:
        return "served"
    p1 = rpc.remote("worker1", make_param, (torch.ones(3),))
    p2 = rpc.remote("worker2", make_param, (torch.ones(3),))
    # every owner fails: the last exception seen is raised, with its type and message
    with pytest.raises(ValueError, match=re.escape("Error creating optimizer. (worker2)")):
        DistributedOptimizer(FailingOnCreate, [p1, p2], lr=0.1)
    with pytest.raises(ValueError, match=re.escape("Error creating optimizer. (worker1)")):
        DistributedOptimizer(FailingOnCreate, [p2, p1], lr=0.1)
    opt = DistributedOptimizer(FailingOnStep, [p1, p2], lr=0.1)
    with dist_autograd.context() as cid:
        loss = (rpc.rpc_sync("worker1", scale_by, (p1, torch.ones(3))) * 2).sum()
        dist_autograd.backward(cid, [loss])
        with pytest.raises(ValueError, match=re.escape("Error running optimizer. (worker2)")):
            opt.step(cid)
    with pytest.raises(
        RuntimeError, match=re.escape("Could not find autograd context with id: 424242")
    ):
        opt.step(424242)
    # .grad after a step holds the context's gradient (as the reference's _LocalOptimizer); a
    # parameter without a gradient in the stepped context is not stepped with an old one
    sgd = DistributedOptimizer(torch.optim.SGD, [p1, p2], lr=0.1)
    for uses_p2 in (True, False):
        with dist_autograd.context() as cid:
            loss = (rpc.rpc_sync("worker1", scale_by, (p1, torch.ones(3))) * 2).sum()
            if uses_p2:
                loss = loss + rpc.rpc_sync("worker2", scale_by, (p2, torch.ones(3))).sum()
            dist_autograd.backward(cid, [loss])
            sgd.step(cid)
        torch.testing.assert_close(rpc.rpc_sync("worker1", grad_of, (p1,)), torch.full((3,), 2.0))
        if uses_p2:
            torch.testing.assert_close(rpc.rpc_sync("worker2", grad_of, (p2,)), torch.ones(3))
        else:
            assert rpc.rpc_sync("worker2", grad_of, (p2,)) is None
    torch.testing.assert_close(p1.to_here(), torch.full((3,), 0.6))
    torch.testing.assert_close(p2.to_here(), torch.full((3,), 0.9))  # stepped once, not twice
    # an empty parameter list: nothing to create, nothing to step (as the reference)
    empty = DistributedOptimizer(torch.optim.SGD, [], lr=0.1)
    assert empty.remote_optimizers == []
    assert repr(opt) == "DistributedOptimizer(FailingOnStep, owners=[worker1, worker2])"
    return "ok"


def test_errors_propagate_and_grad_semantics() -> None:
    """Constructor and step errors of the owners' optimizers arrive with their type and message
    (the last one when several fail); an unknown context id is refused locally; .grad after a
    step holds the context's gradient, and a stale one is never applied again."""
    assert run_workers(errors_program, 3, timeout=60)[0] == "ok"
