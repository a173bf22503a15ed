"""Device maps at ``init_rpc`` with real processes, side by side with torch's RPC on this
(CPU) wheel: a group whose maps name a missing worker or a missing device fails on every
worker with torch's ValueError, and no agent is left set; a joiner of a dynamic group whose
maps do not fit the members it meets fails alike and leaves the group as it was."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch

import distgrad.rpc
from tests._harness import run_workers

pytestmark = pytest.mark.timeout(180)


def _impl(name: str) -> Any:
    if name == "torch":
        import torch.distributed.rpc as torch_rpc

        return torch_rpc
    return distgrad.rpc


def init_with_maps(
    rank: int, world_size: int, port: int, impl: str, maps: dict[int, dict[str, Any]]
) -> dict[str, Any]:
    rpc = _impl(impl)
    options = rpc.TensorPipeRpcBackendOptions(
        init_method=f"tcp://127.0.0.1:{port}", rpc_timeout=30, device_maps=maps.get(rank)
    )
    seen: dict[str, Any] = {}
    try:
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size, rpc_backend_options=options)
    except ValueError as exc:
        seen["init"] = f"ValueError: {exc}"
    else:
        seen["init"] = "ok"
        seen["sum"] = rpc.rpc_sync(f"worker{1 - rank}", torch.add, (torch.ones(2), 1)).tolist()
        rpc.shutdown()
    seen["agent_set"] = rpc.api._is_current_rpc_agent_set()
    return seen


CASES = {
    "missing worker": {0: {"worker9": {"cpu": "cpu"}}},
    "missing device": {1: {"worker0": {"cpu": "cuda:0"}}},
    "cpu to cpu is valid": {0: {"worker1": {"cpu": "cpu"}}, 1: {"worker0": {"cpu": "cpu"}}},
}


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only outcome (no CUDA device)")
@pytest.mark.parametrize("case", sorted(CASES))
def test_init_time_validation_matches_torch(case: str) -> None:
    """Each worker of a 2-worker group sees what it sees on torch's RPC: the same ValueError
    on both workers (or a working group), and no agent set after a failure."""
    outcomes = {
        impl: run_workers(
            init_with_maps, 2, init=False, timeout=90, kwargs={"impl": impl, "maps": CASES[case]}
        )
        for impl in ("torch", "distgrad")
    }
    assert outcomes["distgrad"] == outcomes["torch"]
    first = outcomes["torch"][0]
    if case == "cpu to cpu is valid":
        assert first == {"init": "ok", "sum": [2.0, 2.0], "agent_set": False}
    else:
        assert first["init"].startswith("ValueError: Node worker") and not first["agent_set"]


def dynamic_join(rank: int, world_size: int, port: int, store: str) -> dict[str, Any]:
    rpc = distgrad.rpc
    maps = {"late": {"cpu": "cuda:0"}} if rank == 0 else {}
    options = rpc.TensorPipeRpcBackendOptions(
        init_method=f"file://{store}", rpc_timeout=30, device_maps=maps
    )
    flag = Path(store + ".tried")
    if rank == 0:
        rpc.init_rpc("worker0", rank=0, rpc_backend_options=options)
        deadline = time.monotonic() + 60
        while not flag.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        members = sorted(w.name for w in rpc.api._get_current_rpc_agent().get_worker_infos())
        rpc.shutdown()
        return {"members": members}
    time.sleep(1.0)  # after the leader
    try:
        rpc.init_rpc("late", rank=1, rpc_backend_options=options)
    except ValueError as exc:
        outcome = f"ValueError: {exc}"
    else:
        outcome = "joined"
        rpc.shutdown()
    flag.touch()
    return {"join": outcome, "agent_set": rpc.api._is_current_rpc_agent_set()}


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only outcome (no CUDA device)")
def test_a_joiner_is_validated_against_the_members(tmp_path: Path) -> None:
    """A member maps ``cpu -> cuda:0`` on a worker named ``late`` that has not joined yet (a
    dynamic group does not check names); when ``late`` joins without a GPU, it fails with
    torch's ValueError, no agent is left set there, and the group keeps only its member."""
    results = run_workers(
        dynamic_join, 2, init=False, timeout=120, kwargs={"store": str(tmp_path / "store")}
    )
    assert results[0] == {"members": ["worker0"]}
    assert results[1]["join"] == (
        "ValueError: Node worker0 has target devices with invalid indices in its device map "
        "for late\ndevice map = {device(type='cpu'): device(type='cuda', index=0)}\n"
        "device count = 0"
    )
    assert results[1]["agent_set"] is False
