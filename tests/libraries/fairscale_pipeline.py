"""fairscale 0.4.13's RPC pipeline (``DistributedPipeline``) on CPU, with checkpointing on (its
default, ``except_last``), in the two shapes of fairscale's own ``test_multiprocess_pipe.py``
that distgrad failed before its engine ran each node once per pass
(``multi_input_multi_output_layers`` and ``auto_graph_extract``: a partition whose outputs leave
in two RPCs, so its ``Checkpoint`` node is shared by two send functions). Our own test of that
shape, not fairscale's file: two spawned workers, two training steps (``DistributedLoss``,
``DistributedOptimizer``); worker0 writes the losses, the parameters after the steps and
which RPC ran to OUT_DIR/<case>.json. Nothing distgrad-specific: the test runs it with
``DISTGRAD_PATCH_TORCH=1`` and without, and compares.

Usage: python fairscale_pipeline.py PORT OUT_DIR CASE   (CASE: layers | auto_graph)
"""

import json
import math
import os
import sys

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp
import torch.nn as nn
from fairscale.experimental.nn.distributed_pipeline import (
    DistributedLoss,
    DistributedPipeline,
    PipelineModulesGraph,
)
from torch.distributed.nn import RemoteModule
from torch.distributed.optim import DistributedOptimizer

DEVICES = ["worker0/cpu", "worker1/cpu"]


class Linear(nn.Linear):
    """``nn.Linear`` initialised (as ``nn.Linear`` is) from a generator of its own seed: the same
    parameters on whichever worker, whatever other threads do with the global generator
    meanwhile (RemoteModules are created concurrently on the workers' threads)."""

    def __init__(self, seed, *args):
        super().__init__(*args)
        generator = torch.Generator().manual_seed(seed)
        bound = 1 / math.sqrt(self.in_features)
        with torch.no_grad():
            self.weight.uniform_(-bound, bound, generator=generator)
            self.bias.uniform_(-bound, bound, generator=generator)


class ConcatenateTensors(nn.Module):
    def forward(self, *inputs):
        return torch.cat(inputs, dim=1)


class SplitTensors(nn.Module):
    def forward(self, input):
        return torch.split(input, (input.shape[1] + 1) // 2, dim=1)


class ShardedLinearLayer(nn.Module):
    """A split on one worker, a linear layer per shard on each worker, a concatenation."""

    def __init__(self, input_device, shard_devices, output_device):
        super().__init__()
        self.split = RemoteModule(input_device, SplitTensors, (), {})
        self.linear_layers_2 = nn.ModuleList(
            [
                RemoteModule(shard_devices[0], Linear, (1, 2, 2), {}),
                RemoteModule(shard_devices[1], Linear, (2, 2, 2), {}),
            ]
        )
        self.concatenate = RemoteModule(output_device, ConcatenateTensors, ())

    def forward(self, input):
        shards = self.split(input)
        shards = [self.linear_layers_2[i](shards[i]) for i in range(2)]
        return self.concatenate(*shards)


def layers_pipeline():
    """input -> linear -> split -> (linear on worker0, linear on worker1) -> concatenate."""
    linear_layer_1 = RemoteModule(DEVICES[0], Linear, (3, 4, 4), {})
    split = RemoteModule(DEVICES[0], SplitTensors, (), {})
    linear_layers_2 = [
        RemoteModule(DEVICES[0], Linear, (4, 2, 2), {}),
        RemoteModule(DEVICES[1], Linear, (5, 2, 2), {}),
    ]
    concatenate = RemoteModule(DEVICES[1], ConcatenateTensors, ())
    graph = PipelineModulesGraph()
    graph.add_sequence([linear_layer_1, split], [0], 2)
    for i, layer in enumerate(linear_layers_2):
        graph.add_layer(layer, [(split, i)])
    graph.add_layer(concatenate, linear_layers_2)
    return DistributedPipeline(graph, chunks=4)


def auto_graph_pipeline():
    """The same graph extracted from an ``nn.Sequential`` (fairscale's ``make_graph``)."""
    from fairscale.experimental.nn.distributed_pipeline.trace import make_graph

    model = nn.Sequential(
        RemoteModule(DEVICES[0], Linear, (6, 4, 4), {}),
        ShardedLinearLayer(DEVICES[0], DEVICES, DEVICES[1]),
        RemoteModule(DEVICES[0], Linear, (7, 4, 4), {}),
    )
    return DistributedPipeline(make_graph(model), chunks=4)


def train(case, out_dir):
    criterion = DistributedLoss(torch.nn.MSELoss)
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(3))
    pipe = layers_pipeline() if case == "layers" else auto_graph_pipeline()
    parameter_rrefs = pipe.parameter_rrefs()
    opt = DistributedOptimizer(torch.optim.SGD, parameter_rrefs, lr=0.05)
    losses = []
    for _ in range(2):
        with dist_autograd.context() as context_id:
            y = pipe(x)
            loss = criterion(y, rpc.RRef(x))
            losses.append(loss)
            loss.backward(context_id)
            opt.step(context_id)
    report = {
        "rpc": sys.modules["torch.distributed.rpc"].__name__,
        "losses": [loss.to_here().item() for loss in losses],
        "parameters": [p.to_here().flatten().tolist() for p in parameter_rrefs],
    }
    with open(os.path.join(out_dir, f"{case}.json"), "w") as f:
        json.dump(report, f)


def worker(rank, world_size, port, out_dir, case):
    options = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}")
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size, rpc_backend_options=options)
    if rank == 0:
        train(case, out_dir)
    rpc.shutdown()


if __name__ == "__main__":
    port, out_dir, case = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    mp.spawn(worker, args=(2, port, out_dir, case), nprocs=2)
