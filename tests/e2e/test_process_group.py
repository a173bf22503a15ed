"""RPC next to a gloo process group on the same init method, as in torch's RPC + DDP pattern
(issue 16, item 10): ``dist.init_process_group`` and ``rpc.init_rpc`` share one ``tcp://``,
``file://`` or ``env://`` rendezvous, ``dist.barrier()`` and collectives run around RPC calls,
and remote exceptions that cannot be rebuilt on the caller fail their call at once. The same
program runs on torch's RPC as the reference."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests._harness import run_workers

pytestmark = pytest.mark.timeout(120)


class NeedsTwoArgs(Exception):
    """An exception type that cannot be rebuilt from a message alone."""

    def __init__(self, a: object, b: object) -> None:
        super().__init__(a, b)


class BadRepr(Exception):
    """An exception whose repr() raises."""

    def __repr__(self) -> str:
        raise ValueError("no repr for you")


def raise_needs_two() -> None:
    raise NeedsTwoArgs("first", "second")


def raise_bad_repr() -> None:
    raise BadRepr("x")


def add(x: torch.Tensor, y: float) -> torch.Tensor:
    return x + y


def failure(call: Any) -> dict[str, Any]:
    """What ``call`` raised (type, message) and how long it took."""
    started = time.monotonic()
    try:
        call()
    except Exception as exc:
        return {
            "type": type(exc).__name__,
            "message": str(exc),
            "seconds": time.monotonic() - started,
        }
    raise AssertionError("the call did not raise")


def rpc_and_gloo(
    rank: int, world_size: int, *, impl: str, kind: str, order: str, port: int, path: str
) -> dict[str, Any]:
    import torch.distributed as dist

    if impl == "torch":
        import torch.distributed.rpc as rpc
    else:
        import distgrad.rpc as rpc  # type: ignore[no-redef]
    if kind == "tcp":
        init_method = f"tcp://127.0.0.1:{port}"
    elif kind == "file":
        init_method = f"file://{path}"
    else:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        init_method = "env://"
    opts = rpc.TensorPipeRpcBackendOptions(init_method=init_method, rpc_timeout=30)

    def start_group() -> None:
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)

    def start_rpc() -> None:
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size, rpc_backend_options=opts)

    for start in (start_group, start_rpc) if order == "group_first" else (start_rpc, start_group):
        start()
    peer = f"worker{(rank + 1) % world_size}"
    dist.barrier()
    result = rpc.rpc_sync(peer, add, (torch.ones(2), rank)).tolist()
    dist.barrier()
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    needs_two = failure(lambda: rpc.rpc_sync(peer, raise_needs_two))
    bad_repr = failure(lambda: rpc.rpc_sync(peer, raise_bad_repr))
    dist.barrier()
    after = rpc.rpc_async(peer, add, (torch.zeros(1), 7)).wait().tolist()
    rpc.shutdown()
    dist.barrier()
    dist.destroy_process_group()
    return {
        "result": result,
        "total": total.item(),
        "needs_two": needs_two,
        "bad_repr": bad_repr,
        "after": after,
    }


@pytest.mark.parametrize(
    ("impl", "kind", "order"),
    [
        ("torch", "tcp", "group_first"),
        ("distgrad", "tcp", "group_first"),
        ("distgrad", "file", "rpc_first"),
        ("distgrad", "env", "group_first"),
    ],
)
def test_rpc_with_a_gloo_group_on_the_same_init_method(
    tmp_path: Path, impl: str, kind: str, order: str
) -> None:
    """RPC and a gloo group started (in either order) on one init method work side by side:
    barriers and an all_reduce around RPC calls finish; an exception that cannot be rebuilt
    on the caller arrives at once as torch's RuntimeError ("Original exception on remote side
    was" and the type's name), one whose repr() raises as a RuntimeError too; RPC keeps
    working, and shutdown and destroy_process_group finish."""
    results = run_workers(
        rpc_and_gloo,
        3,
        init=False,
        timeout=90,
        kwargs={"impl": impl, "kind": kind, "order": order, "path": str(tmp_path / "rdzv")},
    )
    for rank, got in results.items():
        assert got["result"] == [1.0 + rank, 1.0 + rank]
        assert got["total"] == 6.0
        assert got["after"] == [7.0]
        needs_two = got["needs_two"]
        assert needs_two["type"] == "RuntimeError", needs_two
        assert "Failed to create original exception type" in needs_two["message"]
        assert "Original exception on remote side was" in needs_two["message"]
        assert "NeedsTwoArgs" in needs_two["message"]
        bad_repr = got["bad_repr"]
        assert bad_repr["type"] == "RuntimeError", bad_repr
        assert "no repr for you" in bad_repr["message"]
        for outcome in (needs_two, bad_repr):
            assert outcome["seconds"] < 10, outcome  # answered, not the 30 s timeout
