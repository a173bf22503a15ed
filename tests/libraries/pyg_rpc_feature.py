"""PyG's distributed feature lookup over RPC, as PyG's own test (test/distributed/test_rpc.py,
``test_dist_feature_lookup``) runs it: two spawned workers, ``torch_geometric.distributed.rpc``
``init_rpc``, ``rpc_partition_to_workers``, a ``LocalFeatureStore`` lookup across the two,
``shutdown_rpc``. Nothing changed but ``DISTGRAD_PATCH_TORCH=1`` in the environment, and one
line added to PyG's test: a ``global_barrier()`` (PyG's own helper) after ``set_rpc_router``.
PyG's test races there: a worker may send its lookup before its peer has registered the call
it targets (``'NoneType' object has no attribute 'rpc_async'``; seen once in four runs on
distgrad with the machine's load at 18 on 2 cores; the same window exists on torch's RPC). Each
worker writes which RPC it ran, and whether shutdown really stopped it, to
OUT_DIR/rank<N>.json.

Usage: python pyg_rpc_feature.py PORT OUT_DIR
"""

import json
import os
import sys

import torch
import torch_geometric.distributed.rpc as rpc
from torch_geometric.distributed import LocalFeatureStore
from torch_geometric.distributed.dist_context import DistContext
from torch_geometric.distributed.rpc import RPCRouter


def run_rpc_feature_test(world_size, rank, feature, partition_book, master_port, out_dir):
    current_ctx = DistContext(
        rank=rank,
        global_rank=rank,
        world_size=world_size,
        global_world_size=world_size,
        group_name="dist-feature-test",
    )
    rpc.init_rpc(current_ctx=current_ctx, master_addr="localhost", master_port=master_port)
    partition_to_workers = rpc.rpc_partition_to_workers(current_ctx, world_size, rank)
    assert partition_to_workers == [["dist-feature-test-0"], ["dist-feature-test-1"]]
    rpc_router = RPCRouter(partition_to_workers)
    assert rpc_router.get_to_worker(partition_idx=0) == "dist-feature-test-0"
    assert rpc_router.get_to_worker(partition_idx=1) == "dist-feature-test-1"
    meta = {"edge_types": None, "is_hetero": False, "node_types": None, "num_parts": 2}
    feature.num_partitions = world_size
    feature.partition_idx = rank
    feature.node_feat_pb = partition_book
    feature.meta = meta
    feature.local_only = False
    feature.set_rpc_router(rpc_router)
    rpc.global_barrier(timeout=60)  # added: both workers' lookups registered (docstring)
    global_id0 = torch.arange(128 * 2)
    global_id1 = torch.arange(128 * 2) + 128 * 2
    tensor0 = feature.lookup_features(global_id0)
    tensor1 = feature.lookup_features(global_id1)
    cpu_tensor0 = torch.cat([torch.ones(128, 1024), torch.ones(128, 1024) * 2])
    cpu_tensor1 = torch.cat([torch.zeros(128, 1024), torch.zeros(128, 1024)])
    assert torch.allclose(cpu_tensor0, tensor0.wait())
    assert torch.allclose(cpu_tensor1, tensor1.wait())
    report = {
        "rpc": sys.modules["torch.distributed.rpc"].__name__,
        "initialized_before": rpc.rpc_is_initialized(),
    }
    rpc.shutdown_rpc()
    assert rpc.rpc_is_initialized() is False
    # the agent is gone: PyG's guard saw it and called the shutdown of the RPC that runs
    report["agent_after"] = sys.modules["torch.distributed.rpc"]._is_current_rpc_agent_set()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)


def main(port, out_dir):
    cpu_tensor0 = torch.cat([torch.ones(128, 1024), torch.ones(128, 1024) * 2])
    cpu_tensor1 = torch.cat([torch.zeros(128, 1024), torch.zeros(128, 1024)])
    global_id0 = torch.arange(128 * 2)
    global_id1 = torch.arange(128 * 2) + 128 * 2
    partition_book = torch.cat(
        [torch.zeros(128 * 2, dtype=torch.long), torch.ones(128 * 2, dtype=torch.long)]
    )
    feature0 = LocalFeatureStore()
    feature0.put_global_id(global_id0, group_name=None)
    feature0.put_tensor(cpu_tensor0, group_name=None, attr_name="x")
    feature1 = LocalFeatureStore()
    feature1.put_global_id(global_id1, group_name=None)
    feature1.put_tensor(cpu_tensor1, group_name=None, attr_name="x")
    mp_context = torch.multiprocessing.get_context("spawn")
    workers = [
        mp_context.Process(
            target=run_rpc_feature_test, args=(2, rank, feature, partition_book, port, out_dir)
        )
        for rank, feature in enumerate((feature0, feature1))
    ]
    for w in workers:
        w.start()
    for w in workers:
        w.join(120)
    for w in workers:
        if w.is_alive():
            w.kill()
            w.join()
    codes = [w.exitcode for w in workers]
    if codes != [0, 0]:
        sys.exit(f"workers exited with {codes}")


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
