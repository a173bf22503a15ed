"""One member of torch's dynamic-group test program (``init_rpc(..., world_size=None)`` on a
``file://`` store, as torch's own dynamic RPC tests run it), written against torch's modules
and run on either implementation: ``python dynamic_parity_worker.py IMPL RANK STORE_FILE``.

Rank 0 starts first; the test starts the others one at a time and tells them when to leave
(a line on stdin). Each rank prints one JSON line per observation; the test compares them
between torch's RPC and distgrad's.
"""

from __future__ import annotations

import json
import sys
import time

import torch


def emit(**seen: object) -> None:
    print(json.dumps(seen), flush=True)


def names(rpc: object) -> list[str]:
    agent = rpc.api._get_current_rpc_agent()  # type: ignore[attr-defined]
    return sorted(w.name for w in agent.get_worker_infos())


def wait_for_members(rpc: object, count: int) -> list[str]:
    deadline = time.monotonic() + 60
    while len(names(rpc)) != count and time.monotonic() < deadline:
        time.sleep(0.05)
    return names(rpc)


def main() -> None:
    impl, rank, store = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    if impl == "torch":
        import torch.distributed.rpc as rpc
    else:
        import distgrad.rpc as rpc  # type: ignore[no-redef]
    options = rpc.TensorPipeRpcBackendOptions(init_method=f"file://{store}", rpc_timeout=30)
    rpc.init_rpc(f"worker{rank}", rank=rank, rpc_backend_options=options)
    emit(rank=rank, joined=names(rpc))
    if rank == 0:
        emit(rank=0, grown=wait_for_members(rpc, 3))
        sums = [
            rpc.rpc_sync(f"worker{r}", torch.add, args=(torch.ones(2), r)).tolist() for r in (1, 2)
        ]
        emit(rank=0, sums=sums)
        emit(rank=0, shrunk=wait_for_members(rpc, 1))
    else:
        emit(
            rank=rank, to_0=rpc.rpc_sync("worker0", torch.add, args=(torch.ones(2), rank)).tolist()
        )
        if rank == 2:
            emit(rank=2, to_1=rpc.rpc_sync("worker1", torch.mul, args=(torch.ones(2), 3)).tolist())
        sys.stdin.readline()  # the test says when to leave
    rpc.shutdown()
    emit(rank=rank, left=True)


if __name__ == "__main__":
    main()
