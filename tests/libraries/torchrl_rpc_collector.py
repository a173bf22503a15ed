"""TorchRL's RPCCollector with its "mp" launcher, as TorchRL's own test
(test/test_distributed.py, ``_test_distributed_collector_basic``) drives it; nothing changed
but ``DISTGRAD_PATCH_TORCH=1`` in the environment. The environment factory runs in each
collector node and writes which RPC that node runs to OUT_DIR/node-<pid>.json.

Usage: python torchrl_rpc_collector.py PORT OUT_DIR FRAMES_PER_BATCH
"""

import json
import os
import sys

import torch
from torchrl.collectors.distributed import RPCCollector
from torchrl.modules import RandomPolicy
from torchrl.testing.mocking_classes import ContinuousActionVecMockEnv

TOTAL_FRAMES = 1000


def _which_rpc():
    c_rpc = getattr(torch._C, "_distributed_rpc", None)
    agent = c_rpc is not None and c_rpc._is_current_rpc_agent_set()
    rpc = sys.modules["torch.distributed.rpc"]
    return {
        "rpc": rpc.__name__,
        "agent_set": bool(agent),
        "worker": rpc.get_worker_info().name if agent else None,
    }


def make_env():
    """Runs in a collector node (TorchRL builds the env there)."""
    with open(os.path.join(os.environ["LIB_TEST_OUT"], f"node-{os.getpid()}.json"), "w") as f:
        json.dump(_which_rpc(), f)
    return ContinuousActionVecMockEnv()


def main(port, out_dir, frames_per_batch):
    os.environ["LIB_TEST_OUT"] = out_dir
    os.environ["RCP_IDLE_TIMEOUT"] = "10"  # as TorchRL's test sets it
    policy = RandomPolicy(ContinuousActionVecMockEnv().action_spec)
    collector = RPCCollector(
        [make_env] * 2,
        policy,
        total_frames=TOTAL_FRAMES,
        frames_per_batch=frames_per_batch,
        launcher="mp",
        tcp_port=str(port),
    )
    try:
        total = 0
        for data in collector:
            total += data.numel()
            assert data.numel() == frames_per_batch, data.numel()
        assert data.names[-1] == "time", data.names
        assert total == TOTAL_FRAMES, total
        trainer = _which_rpc()
    finally:
        collector.shutdown()
    with open(os.path.join(out_dir, "trainer.json"), "w") as f:
        json.dump(trainer, f)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], int(sys.argv[3]))
