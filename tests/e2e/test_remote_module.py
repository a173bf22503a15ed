"""RemoteModule end to end: forward, gradients, parameters, modes, errors and pickling on real
workers, checked against the same module run locally."""

from __future__ import annotations

import io
import pickle
import re
from typing import Any

import pytest
import torch
from torch import nn

import distgrad.autograd as dist_autograd
import distgrad.rpc as rpc
from distgrad.nn import RemoteModule
from distgrad.nn.api.remote_module import RemoteModule as RemoteModuleByPath
from tests._harness import run_workers

pytestmark = pytest.mark.timeout(120)


# -- modules and functions the workers run -----------------------------------------------------
class TwoLayers(nn.Module):
    """A small model with a submodule, kwargs in forward, and a tuple output."""

    def __init__(self, seed: int, scale: float = 1.0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.inner = nn.Sequential(nn.Linear(4, 6), nn.Tanh())
        self.out = nn.Linear(6, 2)
        self.gain = nn.Parameter(torch.tensor(scale))
        self.calls = 0

    def forward(self, x: torch.Tensor, shift: torch.Tensor | None = None) -> Any:
        self.calls += 1
        h = self.inner(x)
        if shift is not None:
            h = h + shift
        return self.out(h) * self.gain, h.sum()


class WithDropout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(x)


class Broken(nn.Module):
    def __init__(self) -> None:
        raise KeyError("no such layer")


def not_a_module() -> int:
    return 3


def owner_grads(module_rref: rpc.RRef[nn.Module], cid: int) -> list[torch.Tensor]:
    grads = dist_autograd.get_gradients(cid)
    return [grads[p] for p in module_rref.local_value().parameters()]


def owner_training(module_rref: rpc.RRef[nn.Module]) -> list[bool]:
    return [m.training for m in module_rref.local_value().modules()]


def owner_calls(module_rref: rpc.RRef[nn.Module]) -> int:
    return module_rref.local_value().calls  # type: ignore[no-any-return]


def use_remote_module(module: RemoteModule, x: torch.Tensor) -> dict[str, Any]:
    """On a third worker: run a received RemoteModule, with a backward pass through it."""
    with dist_autograd.context() as cid:
        xr = x.clone().requires_grad_()
        out, _ = module(xr)
        dist_autograd.backward(cid, [out.sum()])
        return {
            "out": out.detach(),
            "x_grad": dist_autograd.get_gradients(cid)[xr],
            "param_grads": rpc.rpc_sync(
                module.get_module_rref().owner(), owner_grads, (module.get_module_rref(), cid)
            ),
            "is_remote_module": type(module) is RemoteModule,
            "on": module.on,
        }


def echo(value: Any) -> Any:
    return value


def forward_result(module: RemoteModule, x: torch.Tensor) -> torch.Tensor:
    assert isinstance(module, RemoteModule)
    return module(x)[0]  # type: ignore[no-any-return]


class NamedRemote(RemoteModule):
    """A subclass: it pickles through RPC as itself."""

    def name(self) -> str:
        return f"named on {self.on}"


def subclass_name(module: NamedRemote) -> str:
    return module.name()


# -- the programs ----------------------------------------------------------------------------------
def _local_copy(seed: int, scale: float = 1.0) -> TwoLayers:
    return TwoLayers(seed, scale)


def forward_program(rank: int, world_size: int) -> str:
    if rank != 0:
        return "served"
    assert RemoteModuleByPath is RemoteModule
    remote = RemoteModule("worker1/cpu", TwoLayers, args=(11,), kwargs={"scale": 1.5})
    local = _local_copy(11, 1.5)
    x, shift = torch.randn(5, 4), torch.randn(6)
    want = local(x, shift=shift)
    # forward, forward_async and calling the module agree with the local module
    torch.testing.assert_close(remote.forward(x, shift=shift), want)
    torch.testing.assert_close(remote.forward_async(x, shift=shift).wait(), want)
    torch.testing.assert_close(remote(x, shift=shift), want)
    assert rpc.rpc_sync("worker1", owner_calls, (remote.get_module_rref(),)) == 3
    # gradients: inputs here, parameters on the owner, equal to local autograd
    xs = [x.clone().requires_grad_() for _ in range(2)]
    for use_async, xr in zip((False, True), xs, strict=True):
        with dist_autograd.context() as cid:
            out, total = remote.forward_async(xr, shift).wait() if use_async else remote(xr, shift)
            dist_autograd.backward(cid, [(out**2).sum() + total])
            got_x = dist_autograd.get_gradients(cid)[xr]
            got_params = rpc.rpc_sync("worker1", owner_grads, (remote.get_module_rref(), cid))
        xl = x.clone().requires_grad_()
        out_l, total_l = local(xl, shift)
        local.zero_grad()
        ((out_l**2).sum() + total_l).backward()
        torch.testing.assert_close(got_x, xl.grad)
        torch.testing.assert_close(got_params, [p.grad for p in local.parameters()])
    # remote_parameters: RRefs owned by worker1, with the module's values, recurse or not
    params = remote.remote_parameters()
    assert [p.owner_name() for p in params] == ["worker1"] * 5
    torch.testing.assert_close([p.to_here() for p in params], list(local.parameters()))
    direct = remote.remote_parameters(recurse=False)
    torch.testing.assert_close([p.to_here() for p in direct], [local.gain])
    # "rank:1" and a worker name alone (device cpu) work too
    by_rank = RemoteModule("rank:1", TwoLayers, (11,))
    assert (by_rank.on, by_rank.device, by_rank.is_device_map_set) == (1, "cpu", False)
    torch.testing.assert_close(by_rank(x)[0], _local_copy(11)(x)[0])
    by_name = RemoteModule("worker2", TwoLayers, (11,))
    assert (by_name.on, by_name.device) == ("worker2", "cpu")
    assert by_name.get_module_rref().owner_name() == "worker2"
    assert "RemoteModule(on='worker2', device='cpu', module_rref=UserRRef(" in repr(by_name)
    return "ok"


def test_forward_gradients_and_parameters_match_local() -> None:
    """forward, forward_async and __call__ equal the local module's output (kwargs, tuple
    outputs); gradients of inputs and of the owner's parameters equal local autograd's;
    remote_parameters(recurse) and every remote_device form work."""
    assert run_workers(forward_program, 3, timeout=90)[0] == "ok"


UNSUPPORTED = [
    ("register_buffer", ("b", torch.ones(1))),
    ("register_parameter", ("p", None)),
    ("add_module", ("m", None)),
    ("apply", (print,)),
    ("cuda", ()),
    ("ipu", ()),
    ("xpu", ()),
    ("cpu", ()),
    ("type", (torch.float64,)),
    ("float", ()),
    ("double", ()),
    ("half", ()),
    ("bfloat16", ()),
    ("to", ("cpu",)),
    ("register_backward_hook", (print,)),
    ("register_forward_pre_hook", (print,)),
    ("register_forward_hook", (print,)),
    ("state_dict", ()),
    ("load_state_dict", ({},)),
    ("named_parameters", ()),
    ("buffers", ()),
    ("named_buffers", ()),
    ("children", ()),
    ("named_children", ()),
    ("modules", ()),
    ("named_modules", ()),
    ("requires_grad_", ()),
    ("zero_grad", ()),
    ("share_memory", ()),
    ("extra_repr", ()),
]


def api_program(rank: int, world_size: int) -> str:
    if rank != 0:
        return "served"
    remote = RemoteModule("worker1/cpu", WithDropout)
    # train / eval reach the owner (the submodules too)
    assert remote.eval() is remote and remote.training is False
    assert rpc.rpc_sync("worker1", owner_training, (remote.module_rref,)) == [False, False]
    torch.testing.assert_close(remote(torch.ones(100)), torch.ones(100))  # no dropout in eval
    assert remote.train() is remote and remote.training is True
    assert rpc.rpc_sync("worker1", owner_training, (remote.module_rref,)) == [True, True]
    assert (remote(torch.ones(100)) == 0).any()  # dropout in training
    remote.train(False)
    assert rpc.rpc_sync("worker1", owner_training, (remote.module_rref,)) == [False, False]
    # as a submodule of a local model (the usual hybrid model): called and switched through it
    hybrid = nn.Sequential(remote, nn.ReLU())
    hybrid.train()
    assert rpc.rpc_sync("worker1", owner_training, (remote.module_rref,)) == [True, True]
    assert hybrid(-torch.ones(100)).eq(0).all()
    # unsupported methods: the reference's messages
    for name, args in UNSUPPORTED:
        with pytest.raises(
            ValueError, match=f"^{re.escape(f'Method ``{name}`` not supported for RemoteModule')}$"
        ):
            getattr(remote, name)(*args)
    with pytest.raises(
        ValueError,
        match=re.escape(
            "Method ``parameters`` not supported for RemoteModule. Please use "
            "``remote_parameters`` instead."
        ),
    ):
        remote.parameters()
    # Python pickling is refused
    refused = re.escape(
        "Cannot pickle RemoteModule in python pickler. RemoteModule can only be pickled when "
        "using RPC"
    )
    with pytest.raises(RuntimeError, match=refused):
        pickle.dumps(remote)
    with pytest.raises(RuntimeError, match=refused):
        torch.save(remote, io.BytesIO())
    # creation errors surface on first use, with their type
    bad = RemoteModule("worker1/cpu", not_a_module)
    message = (
        "Expect `module_cls(*args, **kwargs)` returns an instance of <class nn.Module>, but it "
        "returns an instance of <class 'int'>."
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        bad(torch.ones(1))
    with pytest.raises(ValueError, match=re.escape(message)):
        bad.remote_parameters()
    with pytest.raises(KeyError, match="no such layer"):
        RemoteModule("worker2", Broken).forward_async(torch.ones(1)).wait()
    # a device the owner lacks: a clear error on first use (a CPU-only machine here)
    if not torch.cuda.is_available():
        on_gpu = RemoteModule("worker1/cuda:0", nn.Linear, (2, 2))
        with pytest.raises(RuntimeError, match="worker1 has no CUDA device"):
            on_gpu(torch.ones(2))
    # bad remote devices
    with pytest.raises(ValueError, match="Could not parse remote_device: a/b/c"):
        RemoteModule("a/b/c", nn.Linear, (2, 2))
    with pytest.raises(ValueError, match="names no worker"):
        RemoteModule("cpu", nn.Linear, (2, 2))
    with pytest.raises(RuntimeError, match="could not find destination name nobody"):
        RemoteModule("nobody/cpu", nn.Linear, (2, 2))
    return "ok"


def test_modes_unsupported_methods_and_errors() -> None:
    """train/eval reach the owner's module; unsupported nn.Module methods and parameters()
    raise the reference's messages; pickle and torch.save refuse it; creation errors surface on
    first use with their type; bad devices and worker names are refused clearly."""
    assert run_workers(api_program, 3, timeout=90)[0] == "ok"


def sharing_program(rank: int, world_size: int) -> str:
    if rank != 0:
        return "served"
    remote = RemoteModule("worker1/cpu", TwoLayers, (5,))
    local = _local_copy(5)
    x = torch.randn(3, 4)
    # sent to a third worker, which runs it (forward and a backward pass through it)
    got = rpc.rpc_sync("worker2", use_remote_module, (remote, x))
    assert got["is_remote_module"] and got["on"] == "worker1"
    xl = x.clone().requires_grad_()
    out, _ = local(xl)
    out.sum().backward()
    torch.testing.assert_close(got["out"], out.detach())
    torch.testing.assert_close(got["x_grad"], xl.grad)
    torch.testing.assert_close(got["param_grads"], [p.grad for p in local.parameters()])
    # sent to its owner and back: still the same module
    back = rpc.rpc_sync("worker1", echo, (remote,))
    assert type(back) is RemoteModule and back.get_module_rref().owner_name() == "worker1"
    torch.testing.assert_close(back(x)[0], out.detach())
    # init_from_module_rref, here and on another worker: same module (its call count grows)
    calls = rpc.rpc_sync("worker1", owner_calls, (remote.module_rref,))
    twin = RemoteModule.init_from_module_rref("worker1/cpu", remote.get_module_rref())
    torch.testing.assert_close(twin(x)[0], out.detach())
    made_there = rpc.rpc_sync(
        "worker2", RemoteModule.init_from_module_rref, ("worker1", remote.get_module_rref())
    )
    torch.testing.assert_close(rpc.rpc_sync("worker2", forward_result, (made_there, x)), out)
    assert rpc.rpc_sync("worker1", owner_calls, (remote.module_rref,)) == calls + 2
    # a subclass travels as itself
    named = NamedRemote("worker1", TwoLayers, (5,))
    assert rpc.rpc_sync("worker2", subclass_name, (named,)) == "named on worker1"
    torch.testing.assert_close(rpc.rpc_sync("worker2", forward_result, (named, x)), out)
    return "ok"


def test_sent_through_rpc_and_init_from_module_rref() -> None:
    """A RemoteModule sent through RPC to a third worker runs there, gradients included; sent
    to its owner and back it still works; init_from_module_rref shares the module, here and
    when called on another worker; a subclass travels as itself."""
    assert run_workers(sharing_program, 3, timeout=90)[0] == "ok"


def owner_grads_on_cpu(module_rref: rpc.RRef[nn.Module], cid: int) -> list[torch.Tensor]:
    grads = dist_autograd.get_gradients(cid)
    return [grads[p].cpu() for p in module_rref.local_value().parameters()]


def owner_devices(module_rref: rpc.RRef[nn.Module]) -> list[str]:
    return sorted({str(p.device) for p in module_rref.local_value().parameters()})


def gpu_program(rank: int, world_size: int) -> str:
    if rank != 0:
        return "served"
    remote = RemoteModule("worker1/cuda:0", TwoLayers, args=(11,), kwargs={"scale": 1.5})
    assert rpc.rpc_sync("worker1", owner_devices, (remote.get_module_rref(),)) == ["cuda:0"]
    local = _local_copy(11, 1.5)
    x, shift = torch.randn(5, 4), torch.randn(6)
    out, total = remote(x, shift)
    assert out.device.type == "cpu"  # outputs come back to the caller's CPU
    want_out, want_total = local(x, shift)
    torch.testing.assert_close((out, total), (want_out, want_total), rtol=1e-4, atol=1e-5)
    xr = x.clone().requires_grad_()
    with dist_autograd.context() as cid:
        out, total = remote(xr, shift)
        dist_autograd.backward(cid, [(out**2).sum() + total])
        got_x = dist_autograd.get_gradients(cid)[xr]
        got_params = rpc.rpc_sync("worker1", owner_grads_on_cpu, (remote.get_module_rref(), cid))
    xl = x.clone().requires_grad_()
    out_l, total_l = local(xl, shift)
    ((out_l**2).sum() + total_l).backward()
    torch.testing.assert_close(got_x, xl.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(
        got_params, [p.grad for p in local.parameters()], rtol=1e-4, atol=1e-5
    )
    return "ok"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_module_on_the_owners_gpu_matches_local() -> None:
    """A RemoteModule on ``worker1/cuda:0``: its parameters live on the GPU, inputs move there
    and outputs come back to the CPU; forward and distributed-autograd gradients (of the input
    here, of the parameters on the owner) equal one-process CPU autograd's."""
    assert run_workers(gpu_program, 2, timeout=120)[0] == "ok"
