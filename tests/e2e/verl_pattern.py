"""verl's TorchRPC usage pattern (verl PR #1519), as a script -- so that its classes live in
``__main__``: a controller (rank 0) creates an actor on each colocated worker with
``rpc.remote``, then drives them with calls that carry closures, lambdas and tensors, all
pickled by dill through torch's ``rpc.api._use_rpc_pickler``. Every worker runs this file:

    python verl_pattern.py RANK WORLD_SIZE PORT OUT_JSON
"""

from __future__ import annotations

import io
import json
import sys
from typing import Any

import dill
import torch

import distgrad.rpc as rpc
from distgrad._wire._choice import current_pickler
from distgrad.rpc.api import _use_rpc_pickler
from distgrad.rpc.internal import _InternalRPCPickler


class DillRPCPickler(_InternalRPCPickler):
    """The shape verl's backend uses: torch's pickler with dill underneath."""

    def _pickler(self, f: io.BytesIO) -> Any:
        return dill.Pickler(f)

    def _unpickler(self, f: io.BytesIO) -> Any:
        return dill.Unpickler(f)


class Actor:
    """A worker's state, defined in ``__main__`` (plain pickle cannot send it)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.weight = torch.full((1 << 16,), float(rank))

    def apply(self, fn: Any, t: torch.Tensor) -> torch.Tensor:
        return fn(self.weight, t)


def run_on(rref: Any, method: str, *args: Any) -> Any:
    return getattr(rref.local_value(), method)(*args)


def main() -> None:
    rank, world_size, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    result: dict[str, Any] = {"rank": rank}
    with _use_rpc_pickler(DillRPCPickler()):
        options = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}")
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size, rpc_backend_options=options)
        if rank == 0:
            actors = [rpc.remote(f"worker{i}", Actor, args=(i,)) for i in range(1, world_size)]
            scale = 3.0
            closure = lambda w, t: w * scale + t  # noqa: E731  (a closure over ``scale``)
            t = torch.arange(float(1 << 16))
            futures = [rpc.rpc_async(a.owner(), run_on, (a, "apply", closure, t)) for a in actors]
            values = [f.wait() for f in futures]
            result["closure_ok"] = all(
                torch.equal(v, torch.full((1 << 16,), float(i + 1)) * scale + t)
                for i, v in enumerate(values)
            )
            total = rpc.rpc_sync("worker1", lambda x: x.sum().item(), (t,))
            result["lambda_ok"] = total == float(t.sum())
            result["main_class_ok"] = rpc.rpc_sync("worker1", lambda: Actor(7).rank) == 7
        rpc.shutdown()
    result["pickler_restored"] = current_pickler() is None  # (the block has ended)
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
