"""Dead and silent peers: what waits on them fails fast, naming them (SPEC 6, "Dead peers")."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from typing import Any

import pytest

import distgrad.rpc as rpc
from tests._harness import Died, run_workers

pytestmark = pytest.mark.timeout(90)

NOT_INITIALIZED = re.escape(
    "RPC has not been initialized. Call torch.distributed.rpc.init_rpc first."
)
RELEASED = threading.Event()


def slow(seconds: float) -> str:
    time.sleep(seconds)
    return "slept"


def die_soon(delay: float, sig: int) -> None:
    """Send ``sig`` to this process after ``delay`` seconds (from a thread)."""
    timer = threading.Timer(delay, os.kill, (os.getpid(), sig))
    timer.daemon = True
    timer.start()


def release() -> None:
    RELEASED.set()


def sync_call_in_thread(dst: str, seconds: float) -> dict[str, Any]:
    """Start a blocking rpc_sync in a thread; the dict gets its error and when it ended."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = rpc.rpc_sync(dst, slow, (seconds,), timeout=0)
        except Exception as exc:
            outcome["error"] = exc
        outcome["ended"] = time.monotonic()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    outcome["thread"] = thread
    return outcome


def killed_peer(rank: int, world_size: int) -> dict[str, float] | str:
    if rank == 1:
        time.sleep(60)  # killed long before
        return "unreachable"
    if rank == 2:  # a bystander, serving worker0 throughout
        assert RELEASED.wait(60)
        rpc.shutdown(graceful=False)
        return "bystander"
    pending = rpc.rpc_async("worker1", slow, (30.0,))
    pending_no_timeout = rpc.rpc_async("worker1", slow, (30.0,), timeout=0)
    blocked = sync_call_in_thread("worker1", 30.0)
    time.sleep(0.2)  # all three calls are running on worker1
    rpc.rpc_sync("worker1", die_soon, (0.3, signal.SIGKILL))
    killed_at = time.monotonic() + 0.3
    with pytest.raises(RuntimeError, match="worker1") as info:
        pending.wait()
    noticed = time.monotonic() - killed_at
    assert isinstance(info.value, rpc.PeerFailureError), repr(info.value)
    assert noticed < 5.0, f"the death was noticed after {noticed:.1f}s"
    with pytest.raises(rpc.PeerFailureError, match="worker1"):
        pending_no_timeout.wait()
    blocked["thread"].join(10)
    assert isinstance(blocked.get("error"), rpc.PeerFailureError), blocked
    assert "worker1" in str(blocked["error"])
    assert blocked["ended"] - killed_at < 5.0
    # later calls to the dead peer fail at once
    started = time.monotonic()
    with pytest.raises(rpc.PeerFailureError, match="worker1"):
        rpc.rpc_sync("worker1", slow, (0.0,))
    with pytest.raises(rpc.PeerFailureError, match="worker1"):
        rpc.rpc_async("worker1", slow, (0.0,)).wait()
    later = time.monotonic() - started
    assert later < 1.0, f"calls to a known-dead peer took {later:.2f}s to fail"
    # other peers and this worker itself are unaffected
    assert rpc.rpc_sync("worker2", slow, (0.0,)) == "slept"
    assert rpc.rpc_sync("worker0", slow, (0.0,)) == "slept"
    assert rpc.get_worker_info("worker1") == rpc.WorkerInfo("worker1", 1)
    rpc.rpc_sync("worker2", release)
    started = time.monotonic()
    rpc.shutdown(graceful=False)
    stop = time.monotonic() - started
    assert stop < 2.0, f"shutdown(graceful=False) took {stop:.1f}s"
    with pytest.raises(RuntimeError, match=NOT_INITIALIZED):
        rpc.get_worker_info()
    return {"noticed": noticed, "later": later, "shutdown": stop}


def test_killed_peer_fails_pending_calls_fast() -> None:
    """worker1 is SIGKILLed while worker0 waits on it (rpc_async with and without timeout,
    and a blocked rpc_sync): every call fails within 5 s naming worker1; later calls to it
    fail at once; worker2 and worker0 itself keep serving; shutdown(graceful=False) returns
    promptly and leaves RPC uninitialized."""
    results = run_workers(killed_peer, 3, timeout=60, shutdown=False, may_die={1})
    assert results[1] == Died(-signal.SIGKILL)
    assert results[2] == "bystander"
    assert set(results[0]) == {"noticed", "later", "shutdown"}


def silent_peer(rank: int, world_size: int) -> dict[str, float] | str:
    if rank == 1:
        time.sleep(60)  # stopped long before, killed by the harness
        return "unreachable"
    pending = rpc.rpc_async("worker1", slow, (30.0,), timeout=0)
    time.sleep(0.2)
    rpc.rpc_sync("worker1", die_soon, (0.3, signal.SIGSTOP))
    stopped_at = time.monotonic() + 0.3
    with pytest.raises(rpc.PeerFailureError, match="worker1") as info:
        pending.wait()
    noticed = time.monotonic() - stopped_at
    # peer_timeout 1.0 s, heartbeats every 0.2 s: noticed within ~1.2 s (plus scheduling)
    assert noticed < 2.0, f"a silent peer was noticed after {noticed:.1f}s: {info.value}"
    with pytest.raises(rpc.PeerFailureError, match="worker1"):
        rpc.rpc_sync("worker1", slow, (0.0,))
    # a graceful shutdown with a dead peer ends (with an error), it does not wait forever
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="worker1"):
        rpc.shutdown()
    stop = time.monotonic() - started
    assert stop < 3.0, f"graceful shutdown with a dead peer took {stop:.1f}s"
    with pytest.raises(RuntimeError, match=NOT_INITIALIZED):
        rpc.get_worker_info()
    return {"noticed": noticed, "shutdown": stop}


def test_silent_peer_fails_pending_calls_within_the_heartbeat_bound() -> None:
    """worker1 is SIGSTOPped (alive, sockets open, silent) while worker0 waits on a call
    without timeout: with heartbeat_interval=0.2 and peer_timeout=1.0 the call fails within
    2 s naming worker1; a graceful shutdown then raises promptly instead of hanging."""
    results = run_workers(
        silent_peer,
        2,
        timeout=60,
        shutdown=False,
        may_die={1},
        options={"heartbeat_interval": 0.2, "peer_timeout": 1.0},
    )
    assert results[1] == Died(-signal.SIGKILL)
    assert set(results[0]) == {"noticed", "shutdown"}


def busy_python(seconds: float) -> int:
    """Pure-Python work holding the GIL (in 5 ms slices) for ``seconds``."""
    deadline = time.monotonic() + seconds
    n = 0
    while time.monotonic() < deadline:
        n += 1
    return n


def healthy_but_slow(rank: int, world_size: int) -> str:
    if rank != 0:
        return "served"
    # calls longer than peer_timeout, sleeping or computing (while this worker computes too),
    # complete
    futures = [rpc.rpc_async("worker1", slow, (1.6,), timeout=0)]
    futures += [rpc.rpc_async("worker1", busy_python, (1.6,), timeout=0) for _ in range(2)]
    busy_python(1.6)
    assert futures[0].wait() == "slept"
    assert all(f.wait() > 0 for f in futures[1:])
    # an idle connection is kept alive by heartbeats
    time.sleep(1.6)
    assert rpc.rpc_sync("worker1", slow, (0.0,)) == "slept"
    stats = rpc._get_current_rpc_agent().statistics()
    assert stats.dead_peers == (), stats
    return "ok"


def test_slow_and_idle_peers_are_not_declared_dead() -> None:
    """With peer_timeout=1.0, calls running 1.6 s (sleeping or holding the GIL) with both
    workers busy, and a connection idle for 1.6 s, do not make a peer look dead."""
    results = run_workers(
        healthy_but_slow,
        2,
        timeout=60,
        options={"heartbeat_interval": 0.2, "peer_timeout": 1.0},
    )
    assert results == {0: "ok", 1: "served"}


_KEPT: list[Any] = []
_DONE = threading.Event()


def _double(x: Any) -> Any:
    return x * 2


def _open_context_through_worker2() -> int:
    """On worker1: open a context (left open), call worker2 in it; return this pid."""
    import torch

    import distgrad.autograd as dist_autograd

    manager = dist_autograd.context()
    manager.__enter__()
    _KEPT.append(manager)
    rpc.rpc_sync("worker2", _double, (torch.ones(2, requires_grad=True),))
    return os.getpid()


def _contexts() -> int:
    import distgrad.autograd as dist_autograd

    return int(dist_autograd._get_debug_info()["num_autograd_contexts"])


def _finish() -> None:
    _DONE.set()


def orphan_program(rank: int, world_size: int) -> object:
    if rank == 1:
        time.sleep(60)  # killed long before
        return "unreachable"
    if rank == 2:
        _DONE.wait(60)
        rpc.shutdown(graceful=False)
        return "bystander"
    pid = rpc.rpc_sync("worker1", _open_context_through_worker2)
    before = rpc.rpc_sync("worker2", _contexts)
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    after = before
    while after and time.monotonic() - killed < 20:
        time.sleep(0.1)
        after = rpc.rpc_sync("worker2", _contexts)
    released_after = time.monotonic() - killed
    rpc.rpc_sync("worker2", _finish)
    rpc.shutdown(graceful=False)
    return {"before": before, "after": after, "released_after": released_after}


def test_a_killed_workers_orphan_contexts_are_released() -> None:
    """worker1 opens a context and calls worker2 in it, then is SIGKILLed: no one calls worker1
    again, but worker2 probes it (a refused connect proves it dead) and releases the context
    only worker1 could have cleaned up. (It stayed for worker2's life: a killed peer was only
    suspected.)"""
    results = run_workers(orphan_program, 3, timeout=60, shutdown=False, may_die={1})
    outcome = results[0]
    assert isinstance(outcome, dict), outcome
    assert outcome["before"] == 1, outcome
    assert outcome["after"] == 0, outcome
    assert results[2] == "bystander"
