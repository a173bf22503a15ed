"""Peer failure: dead or silent peers fail what waits on them, fast, naming them."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

import distgrad.rpc as rpc
from tests._harness import run_workers as run_cluster

pytestmark = pytest.mark.timeout(120)


def slow(seconds: float) -> str:
    time.sleep(seconds)
    return "slept"


def die_soon(delay: float, sig: int) -> None:
    threading.Timer(delay, os.kill, (os.getpid(), sig)).start()


def killed_peer_program(rank: int, world_size: int, sig: int, bound: float) -> str:
    if rank == 1:
        time.sleep(30)  # killed long before
        return "unreachable"
    if rank == 2:
        # a bystander keeps working with worker0 throughout
        time.sleep(6)
        return "bystander"
    pending = rpc.rpc_async("worker1", slow, (20.0,))
    rpc.rpc_sync("worker1", die_soon, (0.3, sig))
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="worker1") as info:
        pending.wait()
    elapsed = time.monotonic() - started
    assert elapsed < bound, f"noticed after {elapsed:.1f}s: {info.value}"
    assert isinstance(info.value, rpc.PeerFailureError)
    started = time.monotonic()
    with pytest.raises(rpc.PeerFailureError, match="worker1"):
        rpc.rpc_sync("worker1", slow, (0.0,))
    assert time.monotonic() - started < 1.0, "a later call to a dead peer must fail at once"
    assert rpc.rpc_sync("worker2", slow, (0.0,)) == "slept"
    started = time.monotonic()
    rpc.shutdown(graceful=False)
    assert time.monotonic() - started < 5.0
    return "ok"


def test_killed_peer_fails_pending_calls_fast() -> None:
    """SIGKILL: the pending call fails within a second or two naming the peer, later calls
    fail at once, other peers keep working, shutdown(graceful=False) returns promptly."""
    results = run_cluster(
        killed_peer_program,
        3,
        timeout=60,
        shutdown=False,
        may_die=frozenset({1, 2}),
        kwargs={"sig": signal.SIGKILL, "bound": 2.0},
    )
    assert results[0] == "ok"


def test_silent_peer_fails_pending_calls_within_heartbeat_bound() -> None:
    """SIGSTOP (alive but silent, sockets open): the heartbeat timeout fails the call naming
    the peer, within peer_timeout plus one heartbeat interval."""
    results = run_cluster(
        killed_peer_program,
        3,
        timeout=60,
        shutdown=False,
        may_die=frozenset({1, 2}),
        options={"heartbeat_interval": 0.2, "peer_timeout": 1.0},
        kwargs={"sig": signal.SIGSTOP, "bound": 2.5},
    )
    assert results[0] == "ok"
