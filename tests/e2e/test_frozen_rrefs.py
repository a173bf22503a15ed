"""A worker frozen (SIGSTOP) for longer than ``peer_timeout`` in the middle of RRef traffic --
``remote``, ``to_here``, forks to a third worker -- then continued (issue 14): every RRef
operation either succeeds or fails naming a worker within the bound, the owner tables of every
worker end empty, and graceful shutdown returns with no fork left registered.

What the frozen worker's peers sent it while it was stopped (responses, RRef control messages)
waits in its sockets; their connections to it are closed meanwhile, so its first writes after
SIGCONT fail (EPIPE): those requests are sent again on fresh connections, and what waited in
the old sockets is read before they are closed."""

from __future__ import annotations

import gc
import os
import signal
import threading
import time
from typing import Any

import pytest
import torch

import distgrad.rpc as rpc
from tests._harness import run_workers

pytestmark = pytest.mark.timeout(120)

FAST = {"heartbeat_interval": 0.2, "peer_timeout": 1.0}
FREEZE_S = 2.5
TRAFFIC_S = FREEZE_S + 3.0
#: an operation that fails must have failed within this long after it began, or after the
#: frozen worker was continued (for its own operations)
BOUND_S = FREEZE_S + 3.0
STOP = threading.Event()


def make(n: int) -> torch.Tensor:
    return torch.full((4,), float(n))


def through(rref: rpc.RRef[torch.Tensor]) -> float:
    """On a relay: fetch the forked RRef's value."""
    return float(rref.to_here(timeout=0).sum())


def pid() -> int:
    return os.getpid()


def debug_info() -> dict[str, str]:
    gc.collect()
    return rpc._rref_context_get_debug_info()


def _traffic(rank: int, world_size: int, seconds: float) -> dict[str, Any]:
    others = [f"worker{r}" for r in range(world_size) if r != rank]
    ok = 0
    failures: list[tuple[float, str]] = []
    i = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        i += 1
        owner = others[i % len(others)]
        relay = others[(i + 1) % len(others)]
        started = time.monotonic()
        try:
            rref = rpc.remote(owner, make, (i,), timeout=0)
            assert float(rref.to_here(timeout=0).sum()) == 4.0 * i
            assert rpc.rpc_sync(relay, through, (rref,), timeout=0) == 4.0 * i
            del rref
            ok += 1
        except Exception as exc:
            failures.append((time.monotonic() - started, f"{type(exc).__name__}: {exc}"))
        time.sleep(0.01)
    gc.collect()
    return {"ok": ok, "failures": failures}


def frozen_rref_program(rank: int, world_size: int) -> dict[str, Any]:
    from distgrad._rpc._rrefs._rref_context import leaks_of

    agent = rpc._get_current_rpc_agent()
    if rank == 0:  # the driver: stops worker1 during the traffic, and continues it
        target = rpc.rpc_sync("worker1", pid)
        timer = threading.Timer(1.0, os.kill, (target, signal.SIGSTOP))
        waking = threading.Timer(1.0 + FREEZE_S, os.kill, (target, signal.SIGCONT))
        timer.start()
        waking.start()
    outcome = _traffic(rank, world_size, TRAFFIC_S)
    if rank == 0:
        timer.join()
        waking.join()
    # every worker's RRef tables drain (deletes of the users reach the owners)
    rpc.api._barrier([f"worker{r}" for r in range(world_size)])
    deadline = time.monotonic() + 10
    tables: dict[str, str] = {}
    while time.monotonic() < deadline:
        tables = debug_info()
        if tables["num_owner_rrefs"] == "0" and tables["num_forks"] == "0":
            break
        time.sleep(0.1)
    outcome["tables"] = tables
    stopping = time.monotonic()
    try:
        rpc.shutdown(timeout=20)
        outcome["shutdown"] = "ok"
    except Exception as exc:
        outcome["shutdown"] = f"{type(exc).__name__}: {exc}"
    outcome["shutdown_s"] = time.monotonic() - stopping
    outcome["leaks"] = len(leaks_of(agent))
    return outcome


def test_rref_traffic_rides_through_a_frozen_worker() -> None:
    results = run_workers(frozen_rref_program, 3, timeout=90, options=FAST, shutdown=False)
    print({r: {k: v for k, v in o.items() if k != "failures"} for r, o in results.items()})
    for rank, outcome in results.items():
        assert outcome["ok"] > 0, (rank, outcome)
        for took, message in outcome["failures"]:
            assert "worker" in message, (rank, message)
            assert took < BOUND_S, (rank, took, message)
        assert outcome["tables"]["num_owner_rrefs"] == "0", (rank, outcome["tables"])
        assert outcome["tables"]["num_forks"] == "0", (rank, outcome["tables"])
        assert outcome["leaks"] == 0, (rank, outcome)
        assert outcome["shutdown"] == "ok", (rank, outcome)
        assert outcome["shutdown_s"] < 10, (rank, outcome)
