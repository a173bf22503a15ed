"""Suspicion, not death (issue 14): a worker frozen (SIGSTOP) past ``peer_timeout`` has what
waited on it fail, naming it, and is called again successfully once it resumes -- by every
worker, and it calls them too; a short freeze costs nothing; a worker that stalled itself
(a long GIL-holding C call) does not condemn anyone when it wakes; ``fail_stop`` keeps the old
behaviour."""

from __future__ import annotations

import ctypes
import os
import signal
import threading
import time

import pytest

import distgrad.rpc as rpc
from tests._harness import run_workers

pytestmark = pytest.mark.timeout(90)

FAST = {"heartbeat_interval": 0.2, "peer_timeout": 1.0}
RESUMED = threading.Event()


def slow(seconds: float) -> str:
    time.sleep(seconds)
    return "slept"


def pid() -> int:
    return os.getpid()


def resumed() -> None:
    RESUMED.set()


def name() -> str:
    return rpc.get_worker_info().name


def dead_peers() -> tuple[int, ...]:
    return tuple(rpc._get_current_rpc_agent().statistics().dead_peers)


def frozen_program(rank: int, world_size: int, freeze: float, fail_stop: bool) -> object:
    if rank == 1:  # the frozen one: once resumed and told so, it calls everyone
        if not RESUMED.wait(60):
            return "never resumed"
        return [rpc.rpc_sync(f"worker{r}", name) for r in (0, 2)]
    if rank == 2:
        return "bystander"
    target = rpc.rpc_sync("worker1", pid)
    pending = rpc.rpc_async("worker1", slow, (freeze + 1.0,), timeout=0)
    time.sleep(0.1)
    os.kill(target, signal.SIGSTOP)
    stopped = time.monotonic()
    waking = threading.Timer(freeze, os.kill, (target, signal.SIGCONT))
    waking.start()
    outcome: dict[str, object] = {}
    try:
        outcome["pending"] = pending.wait()
    except rpc.PeerFailureError as exc:
        outcome["pending_error"] = str(exc)
        outcome["noticed_after"] = time.monotonic() - stopped
    waking.join()
    try:
        rpc.rpc_sync("worker1", resumed)
        outcome["after"] = [rpc.rpc_sync("worker1", name), rpc.rpc_sync("worker2", name)]
        outcome["remote_from_2"] = rpc.rpc_sync("worker2", _call, ("worker1",))
    except rpc.PeerFailureError as exc:
        outcome["after_error"] = str(exc)
        rpc.rpc_sync("worker1", resumed) if not fail_stop else None
    outcome["dead"] = dead_peers()
    return outcome


def _call(dst: str) -> str:
    return str(rpc.rpc_sync(dst, name))


def test_a_frozen_worker_is_suspected_then_called_again() -> None:
    """Frozen 3 s with peer_timeout 1 s: the call waiting on it fails within the bound naming
    it; after SIGCONT, worker0's and worker2's calls reach it and its own calls reach them, and
    nobody is counted dead."""
    results = run_workers(
        frozen_program, 3, timeout=60, options=FAST, kwargs={"freeze": 3.0, "fail_stop": False}
    )
    outcome = results[0]
    assert isinstance(outcome, dict), outcome
    assert "worker1" in str(outcome.get("pending_error")), outcome
    assert "suspected" in str(outcome["pending_error"])
    assert float(outcome["noticed_after"]) < 2.5  # type: ignore[arg-type]
    assert outcome.get("after") == ["worker1", "worker2"], outcome
    assert outcome["remote_from_2"] == "worker1"
    assert outcome["dead"] == ()
    assert results[1] == ["worker0", "worker2"]


def test_a_short_freeze_costs_nothing() -> None:
    """Frozen 0.5 s (under peer_timeout): the waiting call completes, no error anywhere."""
    results = run_workers(
        frozen_program, 3, timeout=60, options=FAST, kwargs={"freeze": 0.5, "fail_stop": False}
    )
    outcome = results[0]
    assert isinstance(outcome, dict), outcome
    assert outcome.get("pending") == "slept", outcome
    assert outcome.get("after") == ["worker1", "worker2"], outcome
    assert outcome["dead"] == ()


def test_fail_stop_keeps_a_frozen_worker_dead() -> None:
    """With fail_stop, the same freeze condemns worker1 for good: later calls fail."""
    results = run_workers(
        frozen_program,
        3,
        timeout=60,
        options={**FAST, "fail_stop": True},
        kwargs={"freeze": 3.0, "fail_stop": True},
        may_die={1},
        shutdown=False,
    )
    outcome = results[0]
    assert isinstance(outcome, dict), outcome
    assert "worker1" in str(outcome.get("after_error")), outcome
    assert 1 in outcome["dead"]  # type: ignore[operator]


def hold_the_gil(seconds: float) -> None:
    """A C call that keeps the GIL (``PyDLL`` functions do not release it): this process's
    I/O thread cannot run meanwhile -- as in a long ``pickle.dumps`` or a C extension call."""
    ctypes.PyDLL(None).usleep(int(seconds * 1e6))


def stalled_program(rank: int, world_size: int) -> object:
    if rank == 1:
        before = [rpc.rpc_sync(f"worker{r}", name) for r in (0, 2)]  # connections now exist
        hold_the_gil(2.5)  # no heartbeat, no read, for 2.5 s: the peers suspect it
        after = [rpc.rpc_sync(f"worker{r}", name) for r in (0, 2)]
        return {"before": before, "after": after, "dead": dead_peers()}
    time.sleep(4.0)
    return {"call": rpc.rpc_sync("worker1", name), "dead": dead_peers()}


def test_a_stalled_worker_condemns_no_one() -> None:
    """worker1 holds the GIL 2.5 s (peer_timeout 1 s): when it wakes, its own late heartbeat
    tick judges no one; its calls and the others' calls to it succeed; nobody is dead."""
    results = run_workers(stalled_program, 3, timeout=60, options=FAST)
    assert results[1] == {
        "before": ["worker0", "worker2"],
        "after": ["worker0", "worker2"],
        "dead": (),
    }
    assert results[0] == {"call": "worker1", "dead": ()}
    assert results[2] == {"call": "worker1", "dead": ()}
