"""RPC timeouts end to end: per call, default, changed default, and 0 = no timeout."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any

import pytest

import distgrad.rpc as rpc
from tests._harness import run_workers

pytestmark = pytest.mark.timeout(90)


def sleep_then(seconds: float, value: object = None) -> object:
    time.sleep(seconds)
    return value


def timeout_error(ms: int) -> str:
    return "^" + re.escape(
        f"RPCErr:1:RPC ran for more than set timeout ({ms} ms) and will now be marked with an error"
    )


def times_out(call: Callable[[], Any], ms: int) -> float:
    """Assert ``call`` raises the reference's timeout error for ``ms``; return seconds taken."""
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=timeout_error(ms)) as info:
        call()
    assert isinstance(info.value, rpc.RpcTimeoutError)
    return time.monotonic() - started


def timeout_program(rank: int, world_size: int) -> str:
    if rank != 0:
        return "served"
    peer = "worker1"
    assert rpc.get_rpc_timeout() == 30.0  # from the options
    # per-call timeouts, sync and async
    took = times_out(lambda: rpc.rpc_sync(peer, sleep_then, (1.0,), timeout=0.3), 300)
    assert 0.29 <= took < 1.5, took
    fut = rpc.rpc_async(peer, sleep_then, (1.0,), timeout=0.4)
    took = times_out(fut.wait, 400)
    assert 0.39 <= took < 1.5, took
    assert fut.done()
    # a timed-out call's late response is dropped; the next call gets its own result
    assert rpc.rpc_sync(peer, sleep_then, (0.0, "next")) == "next"
    # the default changes for new calls
    rpc._set_rpc_timeout(0.25)
    assert rpc.get_rpc_timeout() == 0.25
    took = times_out(lambda: rpc.rpc_sync(peer, sleep_then, (1.0,)), 250)
    assert took < 1.5, took
    times_out(lambda: rpc.rpc_async(peer, sleep_then, (1.0,)).wait(), 250)
    times_out(lambda: rpc.rpc_sync(peer, sleep_then, (1.0,), timeout=-1), 250)  # -1 = default
    # a per-call timeout overrides the default either way; timeout=0 means no timeout
    patient = rpc.rpc_async(peer, sleep_then, (0.5, "patient"), timeout=0)
    assert rpc.rpc_sync(peer, sleep_then, (0.5, "longer"), timeout=5) == "longer"
    assert rpc.rpc_sync(peer, sleep_then, (0.5, "patient"), timeout=0) == "patient"
    assert patient.wait() == "patient"
    rpc._set_rpc_timeout(0)
    assert rpc.get_rpc_timeout() == 0
    assert rpc.rpc_sync(peer, sleep_then, (0.5, "no default")) == "no default"
    # an RPC to self times out the same way
    rpc._set_rpc_timeout(60)
    times_out(lambda: rpc.rpc_sync("worker0", sleep_then, (0.6,), timeout=0.2), 200)
    # a call made before the default changed keeps its own timeout
    early = rpc.rpc_async(peer, sleep_then, (0.5, "early"))  # 60 s
    rpc._set_rpc_timeout(0.1)
    assert early.wait() == "early"
    rpc._set_rpc_timeout(60)
    # many concurrent timeouts all fire, each near its own deadline
    started = time.monotonic()
    futures = [rpc.rpc_async(peer, sleep_then, (0.8,), timeout=0.1 * (i + 1)) for i in range(5)]
    for i, f in enumerate(futures):
        with pytest.raises(RuntimeError, match=timeout_error(100 * (i + 1))):
            f.wait()
    assert time.monotonic() - started < 1.5
    return "ok"


def test_timeouts() -> None:
    """Per-call timeouts on rpc_sync/rpc_async raise the reference's message near their
    deadline; the options' timeout is the default; ``_set_rpc_timeout`` changes it for new
    calls; -1 means the default and 0 no timeout; the worker keeps serving afterwards."""
    results = run_workers(timeout_program, 2, timeout=75, options={"rpc_timeout": 30})
    assert results == {0: "ok", 1: "served"}
