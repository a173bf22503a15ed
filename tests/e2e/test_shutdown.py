"""shutdown() end to end: graceful drains every call in flight (SPEC 4.3), non-graceful and
timed shutdowns return promptly and always leave RPC uninitialized."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import distgrad.rpc as rpc
from tests._harness import free_port, run_workers

pytestmark = pytest.mark.timeout(90)

NOT_INITIALIZED = re.escape(
    "RPC has not been initialized. Call torch.distributed.rpc.init_rpc first."
)
RAN: list[tuple[object, ...]] = []  # calls of slow_record that ran to completion here
FOLLOW_UPS: list[torch.futures.Future[Any]] = []  # follow-up calls started here
STARTED = threading.Event()
FINISHED = threading.Event()


def slow_record(seconds: float, *tag: object) -> tuple[object, ...]:
    time.sleep(seconds)
    RAN.append(tag)
    return tag


def fire_and_forget(dst: str) -> str:
    """Start a follow-up call and return without waiting for it."""
    FOLLOW_UPS.append(rpc.rpc_async(dst, slow_record, (0.5, "follow-up")))
    return "fired"


def graceful_program(rank: int, world_size: int) -> dict[str, Any]:
    if rank == 0:
        futures = [
            rpc.rpc_async(f"worker{r}", slow_record, (0.5, r, i))
            for r in range(1, world_size)
            for i in range(3)
        ]
        assert rpc.rpc_sync("worker1", fire_and_forget, ("worker2",)) == "fired"
        started = time.monotonic()
        rpc.shutdown()
        waited = time.monotonic() - started
        assert all(f.done() for f in futures)
        values = [f.wait() for f in futures]  # all succeeded
        expected = [(r, i) for r in range(1, world_size) for i in range(3)]
        assert values == expected, values
        assert waited >= 0.3, f"shutdown returned after {waited:.2f}s, before the calls ended"
        with pytest.raises(RuntimeError, match=NOT_INITIALIZED):
            rpc.rpc_async("worker1", slow_record, (0,))
        return {"waited": waited}
    rpc.shutdown()
    follow_ups = [f.wait() for f in FOLLOW_UPS if f.done()]
    return {"ran": sorted(RAN, key=str), "follow_ups": follow_ups, "pending": len(FOLLOW_UPS)}


def test_graceful_shutdown_drains_calls_in_flight() -> None:
    """worker0 fires 9 slow calls (0.5 s) at workers 1-3, and worker1 starts a follow-up call
    to worker2 that it does not wait for; worker0 then shuts down at once. Every worker's
    graceful shutdown returns only after all of them ran: every future succeeded, each callee
    ran its calls, and worker1's follow-up had completed when its shutdown returned."""
    results = run_workers(graceful_program, 4, timeout=60, shutdown=False)
    ran = {r: [(r, 0), (r, 1), (r, 2)] for r in (1, 2, 3)}
    assert results[1] == {"ran": ran[1], "follow_ups": [("follow-up",)], "pending": 1}
    assert results[2]["ran"] == sorted([*ran[2], ("follow-up",)], key=str)
    assert results[3]["ran"] == ran[3]
    assert results[2]["follow_ups"] == [] and results[3]["follow_ups"] == []


def tracked_slow(seconds: float) -> str:
    STARTED.set()
    time.sleep(seconds)
    FINISHED.set()
    return "slept"


def has_started() -> bool:
    return STARTED.is_set()


def echo(x: object) -> object:
    return x


def abrupt_program(rank: int, world_size: int) -> dict[str, float] | str:
    if rank == 1:
        assert FINISHED.wait(30)
        time.sleep(0.3)  # worker0 is long gone: this worker's reply to it went nowhere
        started = time.monotonic()
        with pytest.raises(rpc.PeerFailureError, match="worker0"):
            rpc.rpc_sync("worker0", echo, (1,))
        assert time.monotonic() - started < 1.0
        assert rpc.rpc_sync("worker1", echo, (2,)) == 2  # still serving itself
        rpc.shutdown(graceful=False)
        return "survived"
    pending = rpc.rpc_async("worker1", tracked_slow, (1.5,))
    deadline = time.monotonic() + 10
    while not rpc.rpc_sync("worker1", has_started):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    started = time.monotonic()
    rpc.shutdown(graceful=False)
    took = time.monotonic() - started
    assert took < 1.0, f"shutdown(graceful=False) took {took:.2f}s"
    assert pending.done()
    with pytest.raises(RuntimeError, match="shut down"):
        pending.wait()
    for call in (rpc.get_worker_info, rpc.shutdown, lambda: rpc.rpc_sync("worker1", echo, (1,))):
        with pytest.raises(RuntimeError, match=NOT_INITIALIZED):
            call()
    return {"took": took}


def test_non_graceful_shutdown_returns_at_once() -> None:
    """shutdown(graceful=False) with a call in flight returns within a second, fails the
    pending future, and leaves RPC uninitialized (a second shutdown says so); the callee
    survives the vanished caller, notices it is gone, and shuts down itself."""
    results = run_workers(abrupt_program, 2, timeout=60, shutdown=False)
    assert results[1] == "survived"
    assert results[0]["took"] < 1.0


def stubborn_program(rank: int, world_size: int) -> dict[str, Any]:
    if rank == 1:
        time.sleep(2.0)  # does not reach shutdown within worker0's timeout
        started = time.monotonic()
        rpc.shutdown(timeout=2.0)  # worker0 has gone meanwhile: left out, with a warning
        took = time.monotonic() - started
        assert took < 2.5, f"shutdown(timeout=2.0) took {took:.2f}s"
        assert not rpc._is_current_rpc_agent_set()
        return {"took": took, "error": None}
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="timed out in _all_gather") as info:
        rpc.shutdown(timeout=1.0)
    took = time.monotonic() - started
    assert 0.9 <= took < 2.5, f"shutdown(timeout=1.0) took {took:.2f}s"
    with pytest.raises(RuntimeError, match=NOT_INITIALIZED):
        rpc.get_worker_info()
    return {"took": took, "error": str(info.value)}


def test_shutdown_timeout_with_a_peer_that_does_not_shut_down() -> None:
    """worker0's shutdown(timeout=1.0) while worker1 is busy elsewhere raises the reference's
    "timed out in _all_gather" within the bound and resets the agent; worker1's later
    shutdown(timeout=2.0) returns within its bound: worker0 is gone (it said goodbye), so it
    is left out of the gathers, with a warning naming it."""
    results = run_workers(stubborn_program, 2, timeout=60, shutdown=False)
    assert "worker1" in results[0]["error"], results[0]
    assert results[1]["error"] is None, results[1]


def stop_serving() -> str:
    """Stop this worker's pool of worker threads, as the last step of its shutdown does."""
    rpc._get_current_rpc_agent()._workers.stop()
    return "stopped"


def late_request_program(rank: int, world_size: int, marker: str) -> dict[str, Any] | str:
    done = Path(marker)
    if rank == 1:
        deadline = time.monotonic() + 30
        while not done.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        rpc.shutdown(graceful=False)
        return "served"
    assert rpc.rpc_sync("worker1", stop_serving) == "stopped"
    started = time.monotonic()
    with pytest.raises(rpc.RpcShutdownError, match="worker1 is shutting down") as caught:
        rpc.rpc_sync("worker1", echo, (1,), timeout=30)
    took = time.monotonic() - started
    done.touch()
    rpc.shutdown(graceful=False)
    return {"took": took, "error": str(caught.value)}


def test_request_to_a_worker_that_stopped_serving_fails_at_once(tmp_path: Path) -> None:
    """A request that reaches a worker whose worker threads have stopped (the end of its
    shutdown) is answered with an error at once; the caller does not wait out its timeout."""
    results = run_workers(
        late_request_program,
        2,
        timeout=60,
        shutdown=False,
        kwargs={"marker": str(tmp_path / "done")},
    )
    assert results[1] == "served"
    assert results[0]["took"] < 5.0, results[0]


_EXIT_WITHOUT_SHUTDOWN = """
import atexit, os, threading
import distgrad.rpc as rpc

def check():  # registered before init_rpc: runs after distgrad's own exit hook
    alive = sorted(t.name for t in threading.enumerate() if t.name.startswith("distgrad"))
    print("left running at exit:", alive, flush=True)

atexit.register(check)
opts = rpc.TensorPipeRpcBackendOptions(
    init_method=f"tcp://127.0.0.1:{os.environ['PORT']}", heartbeat_interval=0.05
)
rpc.init_rpc("worker0", rank=0, world_size=1, rpc_backend_options=opts)
raise ValueError("the program gives up without shutdown()")
"""


def test_a_program_that_ends_without_shutdown_stops_its_agent_first(tmp_path: Path) -> None:
    """Without ``shutdown()``, the agent is stopped at exit while the interpreter is whole: its
    I/O thread used to outlive it, and a heartbeat timer firing during finalization killed the
    process with SIGSEGV now and then instead of its own exit status."""
    script = tmp_path / "exit.py"
    script.write_text(textwrap.dedent(_EXIT_WITHOUT_SHUTDOWN))
    env = {**os.environ, "PORT": str(free_port())}
    done = subprocess.run(
        [sys.executable, str(script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert "the program gives up without shutdown()" in done.stderr
    assert done.returncode == 1, done.stderr[-2000:]
    assert "left running at exit: []" in done.stdout, done.stdout + done.stderr[-2000:]


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(f"{record.name} {record.levelname} {record.getMessage()}")


def calls_everyone_then_shuts_down(rank: int, world_size: int) -> list[str]:
    """Calls every worker (itself included), shuts down gracefully, and returns every
    record distgrad logged meanwhile, DEBUG included."""
    records = _Records()
    logger = logging.getLogger("distgrad")
    logger.addHandler(records)
    logger.setLevel(logging.DEBUG)
    try:
        for r in range(world_size):
            assert rpc.rpc_sync(f"worker{r}", torch.add, (torch.ones(2), r)).tolist() == [r + 1] * 2
            rpc.remote(f"worker{r}", torch.ones, (2,)).to_here()
        rpc.shutdown()  # returns once every connection is closed (or its timeout passed)
    finally:
        logger.removeHandler(records)
    return records.messages


def test_clean_graceful_shutdown_reports_no_failure() -> None:
    """Three workers that talked to each other shut down gracefully: not one log record, even
    at DEBUG, says a connection failed or a peer closed it unexpectedly."""
    results = run_workers(calls_everyone_then_shuts_down, 3, shutdown=False)
    for rank, messages in results.items():
        bad = [m for m in messages if re.search("fail|unexpected|die|dead|lost", m, re.I)]
        assert not bad, (rank, bad)
