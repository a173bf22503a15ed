"""init_rpc end to end: the rendezvous forms, errors, and init again after shutdown."""

from __future__ import annotations

import os
import re
import sys
import threading
from pathlib import Path

import pytest

import distgrad.rpc as rpc
from tests._harness import free_port, run_workers

pytestmark = pytest.mark.timeout(90)

NOT_INITIALIZED = re.escape(
    "RPC has not been initialized. Call torch.distributed.rpc.init_rpc first."
)


def add(a: int, b: int) -> int:
    return a + b


def whoami() -> str:
    return rpc.get_worker_info().name


def check_group(prefix: str, rank: int, world_size: int) -> None:
    """Every worker of the group answers under its name."""
    for peer in range(world_size):
        assert rpc.rpc_sync(f"{prefix}{peer}", whoami) == f"{prefix}{peer}"
        assert rpc.rpc_sync(peer, add, (rank, peer)) == rank + peer


def lifecycle(rank: int, world_size: int, port: int, ports: list[int], path: str) -> str:
    # before init every API says so
    with pytest.raises(RuntimeError, match=NOT_INITIALIZED):
        rpc.rpc_sync("worker0", add, (1, 1))
    assert not rpc._is_current_rpc_agent_set()
    # 1. tcp://
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}")
    rpc.init_rpc(f"tcp{rank}", rank=rank, world_size=world_size, rpc_backend_options=opts)
    assert rpc._is_current_rpc_agent_set()
    with pytest.raises(RuntimeError, match=r"^RPC is already initialized$"):
        rpc.init_rpc(f"tcp{rank}", rank=rank, world_size=world_size, rpc_backend_options=opts)
    with pytest.raises(RuntimeError, match=r"^RPC is already initialized$"):
        rpc.init_rpc(f"other{rank}", rank=rank, world_size=world_size, rpc_backend_options=opts)
    check_group("tcp", rank, world_size)  # the failed init calls changed nothing
    rpc.shutdown()
    with pytest.raises(RuntimeError, match=NOT_INITIALIZED):
        rpc.get_worker_info()
    # 2. again, on a new tcp:// port, with other names
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{ports[0]}")
    rpc.init_rpc(f"again{rank}", rank=rank, world_size=world_size, rpc_backend_options=opts)
    check_group("again", rank, world_size)
    with pytest.raises(RuntimeError, match="could not find destination name tcp0"):
        rpc.rpc_sync("tcp0", add, (1, 1))
    rpc.shutdown()
    # 3. env:// from torchrun's variables, no rank/world_size arguments
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(ports[1]),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
    )
    rpc.init_rpc(f"env{rank}")
    assert rpc.get_worker_info() == rpc.WorkerInfo(f"env{rank}", rank)
    check_group("env", rank, world_size)
    rpc.shutdown()
    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        del os.environ[key]
    # 4. file://
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"file://{path}")
    rpc.init_rpc(f"file{rank}", rank=rank, world_size=world_size, rpc_backend_options=opts)
    check_group("file", rank, world_size)
    rpc.shutdown()
    with pytest.raises(RuntimeError, match=NOT_INITIALIZED):
        rpc.rpc_async("file0", add, (1, 1))
    return "ok"


def test_init_forms_errors_and_init_again_after_shutdown(tmp_path: Path) -> None:
    """Use before init fails with the reference's message; a second init_rpc fails with "RPC
    is already initialized" and changes nothing; after shutdown the same processes init
    again on a new tcp:// port, then through env:// (MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE,
    no rank or world_size arguments), then through file://, and RPC works each time."""
    results = run_workers(
        lifecycle,
        3,
        init=False,
        timeout=75,
        kwargs={"ports": [free_port(), free_port()], "path": str(tmp_path / "rendezvous")},
    )
    assert results == {0: "ok", 1: "ok", 2: "ok"}


def duplicate_names(rank: int, world_size: int, port: int, second_port: int) -> str:
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}", rpc_timeout=20)
    name = "same-name" if rank < 2 else "unique"
    with pytest.raises(RuntimeError, match="is not unique"):
        rpc.init_rpc(name, rank=rank, world_size=world_size, rpc_backend_options=opts)
    assert not rpc._is_current_rpc_agent_set()
    with pytest.raises(RuntimeError, match=NOT_INITIALIZED):
        rpc.rpc_sync("same-name", add, (1, 1))
    # the failed init left nothing behind: the same processes form a proper group
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{second_port}")
    rpc.init_rpc(f"fixed{rank}", rank=rank, world_size=world_size, rpc_backend_options=opts)
    check_group("fixed", rank, world_size)
    rpc.shutdown()
    return "ok"


def test_duplicate_worker_names() -> None:
    """When two of three workers share a name every worker's init_rpc fails with "is not
    unique" and leaves RPC uninitialized; the processes can then init properly."""
    results = run_workers(
        duplicate_names, 3, init=False, timeout=60, kwargs={"second_port": free_port()}
    )
    assert results == {0: "ok", 1: "ok", 2: "ok"}


def _hog_the_gil() -> None:
    while True:
        pass


def duplicate_names_slow(rank: int, world_size: int, port: int) -> str:
    if rank > 0:  # a slow worker: every GIL hand-over takes 0.2 s
        sys.setswitchinterval(0.2)
        threading.Thread(target=_hog_the_gil, daemon=True).start()
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}", rpc_timeout=20)
    try:
        rpc.init_rpc(
            "same" if rank < 2 else "other",
            rank=rank,
            world_size=world_size,
            rpc_backend_options=opts,
        )
    except RuntimeError as exc:
        return str(exc)
    return "initialized"


def test_duplicate_worker_names_on_slow_workers() -> None:
    """Slow workers also get the "is not unique" error, not a rendezvous-store error."""
    results = run_workers(duplicate_names_slow, 3, init=False, timeout=60)
    assert all("is not unique" in message for message in results.values()), results
