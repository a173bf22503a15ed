"""DistributedDataParallel inside distributed autograd contexts (torch's RPC + DDP tutorial
pattern): a RemoteModule on a parameter server, DDP over a gloo group on the trainers,
DistributedOptimizer, ``dist_autograd.backward`` -- checked against the same training done in
one process with plain torch autograd (DDP averages the trainers' gradients)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import distgrad.autograd as dist_autograd
import distgrad.rpc as rpc
from distgrad.nn import RemoteModule
from distgrad.optim import DistributedOptimizer
from tests._harness import free_port, run_workers

pytestmark = pytest.mark.timeout(120)

STEPS = 3
LR = 0.05


def _initial() -> tuple[nn.Linear, nn.Linear]:
    torch.manual_seed(0)
    return nn.Linear(4, 3), nn.Linear(3, 1)


def _data(trainer: int, step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 * trainer + step)
    return torch.randn(5, 4, generator=generator)


def make_server_layer(weight: torch.Tensor, bias: torch.Tensor) -> nn.Linear:
    layer = nn.Linear(3, 1)
    with torch.no_grad():
        layer.weight.copy_(weight)
        layer.bias.copy_(bias)
    return layer


def ddp_program(rank: int, world_size: int, gloo_port: int) -> Any:
    """Rank 0 is the master and parameter server (as in torch's tutorial): it creates the
    RemoteModule and runs the trainers over RPC; trainers only serve."""
    if rank != 0:
        return None
    _, server = _initial()
    remote = RemoteModule(
        "worker0/cpu", make_server_layer, args=(server.weight.detach(), server.bias.detach())
    )
    futures = [
        rpc.rpc_async(f"worker{t}", run_trainer, args=(remote, t, gloo_port)) for t in (1, 2)
    ]
    results = [future.wait() for future in futures]
    return results, [p.detach().clone() for p in remote.module_rref.local_value().parameters()]


def run_trainer(remote: RemoteModule, trainer: int, gloo_port: int) -> Any:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{gloo_port}", rank=trainer - 1, world_size=2
    )
    try:
        local, _ = _initial()
        model = nn.parallel.DistributedDataParallel(local)
        params = [rpc.RRef(p) for p in model.parameters()] + remote.remote_parameters()
        optimizer = DistributedOptimizer(torch.optim.SGD, params, lr=LR)
        grads_seen = []
        for step in range(STEPS):
            with dist_autograd.context() as context_id:
                loss = remote.forward(model(_data(trainer, step))).sum()
                dist_autograd.backward(context_id, [loss])
                grads = dist_autograd.get_gradients(context_id)
                grads_seen.append([grads[p].clone() for p in model.parameters()])
                dist.barrier()  # both passes are over before either steps the server
                optimizer.step(context_id)
                dist.barrier()
        return grads_seen, [p.detach().clone() for p in model.parameters()]
    finally:
        dist.destroy_process_group()


def _local_reference() -> tuple[list[list[torch.Tensor]], list[torch.Tensor], list[torch.Tensor]]:
    """The same training in one process: DDP's gradient is the trainers' mean, the server
    steps once per trainer with that trainer's own gradient."""
    local, server = _initial()
    grads_seen = []
    for step in range(STEPS):
        per_trainer = []
        server_grads = []
        for trainer in (1, 2):
            local.zero_grad()
            server.zero_grad()
            server(local(_data(trainer, step))).sum().backward()
            per_trainer.append([p.grad.clone() for p in local.parameters()])
            server_grads.append([p.grad.clone() for p in server.parameters()])
        mean = [(a + b) / 2 for a, b in zip(*per_trainer, strict=True)]
        grads_seen.append(mean)
        with torch.no_grad():
            for param, g in zip(local.parameters(), mean, strict=True):
                param.sub_(LR * g)
            for grads in server_grads:
                for param, g in zip(server.parameters(), grads, strict=True):
                    param.sub_(LR * g)
    return (
        grads_seen,
        [p.detach() for p in local.parameters()],
        [p.detach() for p in server.parameters()],
    )


def test_ddp_in_a_context_averages_gradients_as_torch_does() -> None:
    """DDP's reducer hooks run in a distributed backward: each step's context gradients of the
    DDP parameters are the trainers' mean on both trainers, the replicas stay equal, and the
    server and replicas end where one-process training ends."""
    trainers, served = run_workers(ddp_program, 3, timeout=100, kwargs={"gloo_port": free_port()})[
        0
    ]
    expected_grads, expected_local, expected_server = _local_reference()
    for grads_seen, final in trainers:
        for step in range(STEPS):
            for got, want in zip(grads_seen[step], expected_grads[step], strict=True):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        for got, want in zip(final, expected_local, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for got, want in zip(served, expected_server, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_ddp_rpc_example() -> None:
    """``examples/ddp_rpc.py`` (torch's RPC + DDP tutorial shape) trains with its gradient
    check passing and the DDP replicas equal at the end."""
    from tests.e2e.test_examples import EXAMPLES, assert_gradient_check_passed, run_example

    output = run_example(str(EXAMPLES / "ddp_rpc.py"), "--trainers", "2", "--steps", "4")
    assert_gradient_check_passed(output)
    assert "DDP replicas after training: max spread 0.00e+00" in output
