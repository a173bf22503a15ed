"""A stall of this process is not its peers' silence (issue 14, item 8): a worker that was not
running -- a C call holding the GIL, a stopped host -- reads what its peers sent meanwhile
before it judges any of them."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import time
from typing import Any

import pytest

import distgrad.rpc as rpc
from tests._harness import run_workers

pytestmark = pytest.mark.timeout(90)


def echo(x: object) -> object:
    return x


def pid() -> int:
    return os.getpid()


def hold_gil(seconds: float) -> None:
    """One C call that keeps the GIL for ``seconds`` (ctypes.PyDLL does not release it)."""
    ctypes.PyDLL(None).usleep(int(seconds * 1e6))


def after_stall(rank: int, world_size: int) -> dict[str, Any]:
    """Wait for the peers' heartbeats to catch up, then call every worker."""
    time.sleep(2.5)
    stats = rpc._get_current_rpc_agent().statistics()
    calls = [rpc.rpc_sync(f"worker{r}", echo, (r,), timeout=10) for r in range(world_size)]
    return {"calls": calls, "dead": list(stats.dead_peers), "stalls": stats.stalls}


def gil_held_longer_than_peer_timeout(rank: int, world_size: int) -> dict[str, Any]:
    rpc.rpc_sync(f"worker{1 - rank}", echo, (0,))  # connections both ways
    rpc.api._barrier(["worker0", "worker1"])
    if rank == 1:
        hold_gil(6.0)  # longer than this worker's peer_timeout (4 s), within worker0's
    out = after_stall(rank, world_size)
    rpc.api._barrier(["worker0", "worker1"])
    return out


def test_a_worker_holding_the_gil_does_not_condemn_its_peers_when_it_wakes() -> None:
    """worker1 holds the GIL for 6 s in one C call (its peer timeout 4 s, worker0's 10 s):
    on waking it does not declare worker0 dead for the silence it did not hear (worker0's
    heartbeats waited, unread, in the socket); calls both ways then succeed."""
    results = run_workers(
        gil_held_longer_than_peer_timeout,
        2,
        timeout=60,
        rank_options={0: {"peer_timeout": 10.0}, 1: {"peer_timeout": 4.0}},
    )
    for rank in (0, 1):
        assert results[rank]["dead"] == [], results
        assert results[rank]["calls"] == [0, 1]
    assert results[1]["stalls"] >= 1


def host_stopped(rank: int, world_size: int) -> dict[str, Any]:
    rpc.rpc_sync(f"worker{1 - rank}", echo, (0,))  # connections both ways
    if rank == 0:
        pids = f"{os.getpid()} {rpc.rpc_sync('worker1', pid)}"
        # a helper stops both workers together for 6 s, as a paused VM or a stalled host would
        helper = subprocess.Popen(
            ["sh", "-c", f"sleep 0.3; kill -STOP {pids}; sleep 6; kill -CONT {pids}"]
        )
        try:
            helper.wait(timeout=30)  # worker0 is stopped somewhere in here
        finally:
            if helper.poll() is None:
                helper.kill()
                helper.wait()
            os.kill(int(pids.split()[1]), signal.SIGCONT)
        rpc.rpc_sync("worker1", echo, (1,), timeout=10)  # worker1 has resumed too
    else:
        time.sleep(8.0)
    out = after_stall(rank, world_size)
    rpc.api._barrier(["worker0", "worker1"])
    return out


def test_workers_stopped_together_do_not_condemn_each_other() -> None:
    """Both workers stopped (SIGSTOP) for 6 s at once, longer than the peer timeout (4 s):
    neither blames the other for the silence of a stall they shared; calls both ways then
    succeed."""
    results = run_workers(host_stopped, 2, timeout=60)
    for rank in (0, 1):
        assert results[rank]["dead"] == [], results
        assert results[rank]["calls"] == [0, 1]
        assert results[rank]["stalls"] >= 1
