"""An unmodified torch RPC program: it imports only torch's modules (torch.distributed.rpc,
torch.distributed.autograd, DistributedOptimizer, RemoteModule) and starts its workers with
torch.multiprocessing.spawn. tests/e2e/test_patch_torch.py runs it with
DISTGRAD_PATCH_TORCH=1 (distgrad's RPC), without it (torch's), and on a torch whose RPC is
hidden.

Rank 0 trains a model split across the two workers (a RemoteModule on worker1, a local layer)
with distributed autograd and DistributedOptimizer, and the same model in one process with
torch's autograd; it also calls the private names libraries use. Each rank writes what it saw
to OUT_DIR/rank<N>.json: which module was torch.distributed.rpc, the checks libraries make.

Usage: python torch_program.py PORT OUT_DIR
"""

import copy
import json
import os
import sys

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp
from torch.distributed.nn import RemoteModule
from torch.distributed.optim import DistributedOptimizer
from torch.distributed.rpc import RRef

STEPS = 3


def _double(x):
    return x * 2


def _train(report):
    torch.manual_seed(0)
    remote = RemoteModule("worker1/cpu", torch.nn.Linear, args=(4, 3))
    local = torch.nn.Linear(3, 2)
    ref_remote = torch.nn.Linear(4, 3)
    with torch.no_grad():
        for mine, theirs in zip(ref_remote.parameters(), remote.remote_parameters(), strict=True):
            mine.copy_(theirs.to_here())
    ref_local = copy.deepcopy(local)
    ref_opt = torch.optim.SGD([*ref_remote.parameters(), *ref_local.parameters()], lr=0.1)
    params = [RRef(p) for p in local.parameters()] + remote.remote_parameters()
    opt = DistributedOptimizer(torch.optim.SGD, params, lr=0.1)
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    loss_diffs, grad_diffs = [], []
    for _ in range(STEPS):
        with dist_autograd.context() as context_id:
            loss = ((local(remote(x)) - y) ** 2).mean()
            dist_autograd.backward(context_id, [loss])
            grads = dist_autograd.get_gradients(context_id)
            opt.step(context_id)
        ref_opt.zero_grad()
        ref_loss = ((ref_local(ref_remote(x)) - y) ** 2).mean()
        ref_loss.backward()
        grad_diffs += [
            (grads[p] - r.grad).abs().max().item()
            for p, r in zip(local.parameters(), ref_local.parameters(), strict=True)
        ]
        ref_opt.step()
        loss_diffs.append(abs(loss.item() - ref_loss.item()))
    param_diffs = [
        (p.to_here() - r).abs().max().item()
        for p, r in zip(remote.remote_parameters(), ref_remote.parameters(), strict=True)
    ] + [
        (p - r).abs().max().item()
        for p, r in zip(local.parameters(), ref_local.parameters(), strict=True)
    ]
    report.update(loss_diffs=loss_diffs, grad_diffs=grad_diffs, param_diffs=param_diffs)


def _private_names(report):
    # the names TorchRL, PyG, GraphLearn-for-PyTorch and fairscale use (docs/libraries.md)
    c_rpc = torch._C._distributed_rpc
    rref = rpc.remote(1, _double, args=(torch.ones(2),))  # a worker id, not a name
    report["rref_is_pyrref"] = isinstance(rref, c_rpc.PyRRef)
    report["to_here_unbound"] = c_rpc.PyRRef.to_here(rref).tolist()
    report["owner_unbound"] = c_rpc.PyRRef.owner(rref).name
    report["rpc_async_int"] = rpc.rpc_async(1, torch.add, args=(torch.ones(2), 1)).wait().tolist()
    report["rpc_sync_int"] = rpc.rpc_sync(1, _double, args=(torch.ones(1),)).tolist()
    report["require_initialized"] = rpc.api._require_initialized(lambda: "ran")()
    states = rpc.AllGatherStates()
    report["all_gather_states"] = [
        type(states.gathered_objects).__name__,
        states.proceed_signal.is_set(),
    ]


def worker(rank, world_size, port, out_dir):
    options = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}", rpc_timeout=60)
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size, rpc_backend_options=options)
    report = {
        "rpc_module": sys.modules["torch.distributed.rpc"].__name__,
        "autograd_module": sys.modules["torch.distributed.autograd"].__name__,
        "optimizer": DistributedOptimizer.__module__,
        "remote_module": RemoteModule.__module__,
        "agent_set": torch._C._distributed_rpc._is_current_rpc_agent_set(),
        "env": os.environ.get("DISTGRAD_PATCH_TORCH"),
    }
    if rank == 0:
        _train(report)
        _private_names(report)
    report["gathered"] = rpc.api._all_gather(rank)
    rpc.shutdown(True, 60)  # positional: graceful, timeout
    report["agent_set_after"] = torch._C._distributed_rpc._is_current_rpc_agent_set()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    mp.spawn(worker, args=(2, int(sys.argv[1]), sys.argv[2]), nprocs=2, join=True)
