"""Nested RPCs (a UDF that makes RPCs) and ``@async_execution``, end to end."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

import distgrad.rpc as rpc
from tests._harness import run_workers

pytestmark = pytest.mark.timeout(90)


def ring(path: list[str], x: torch.Tensor, visited: list[str]) -> tuple[torch.Tensor, list[str]]:
    """Add 1, record this worker, and pass on along ``path``."""
    visited = [*visited, rpc.get_worker_info().name]
    if not path:
        return x + 1, visited
    return rpc.rpc_sync(path[0], ring, (path[1:], x + 1, visited))  # type: ignore[no-any-return]


def ring_async_hop(path: list[str], x: torch.Tensor) -> torch.Tensor:
    """As ``ring``, but each hop waits on an rpc_async future."""
    if not path:
        return x + 1
    return rpc.rpc_async(path[0], ring_async_hop, (path[1:], x + 1)).wait()  # type: ignore[no-any-return]


def ring_then_hop(path: list[str], x: torch.Tensor) -> torch.Tensor:
    """As ``ring_async_hop``, but each hop waits on a future chained with ``then``."""
    if not path:
        return x + 1
    future = rpc.rpc_async(path[0], ring_then_hop, (path[1:], x + 1))
    return future.then(lambda done: done.wait()).wait()  # type: ignore[no-any-return]


@rpc.functions.async_execution
def async_add_then_double(dst: str, x: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    return rpc.rpc_async(dst, torch.add, (x, 1)).then(lambda fut: fut.wait() * 2)


@rpc.functions.async_execution
def async_slow_chain(dst: str, x: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    """Completes only after a nested call that itself makes a nested call."""
    return rpc.rpc_async(dst, ring, ([], x, [])).then(
        lambda fut: rpc.rpc_sync(dst, torch.mul, (fut.wait()[0], 10))
    )


@rpc.functions.async_execution
def add_later(x: torch.Tensor, seconds: float) -> torch.futures.Future[torch.Tensor]:
    """Completes from a timer thread: no worker thread waits meanwhile."""
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    timer = threading.Timer(seconds, lambda: fut.set_result(x + 1))
    timer.daemon = True
    timer.start()
    return fut


@rpc.functions.async_execution
def async_sleepy(dst: str, x: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    return rpc.rpc_async(dst, add_later, (x, 0.5))


class AsyncOps:
    @staticmethod
    @rpc.functions.async_execution
    def static_add(dst: str, x: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
        return rpc.rpc_async(dst, torch.add, (x, 2))

    @classmethod
    @rpc.functions.async_execution
    def class_add(cls, dst: str, x: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
        return rpc.rpc_async(dst, torch.add, (x, 3))


def nested_program(rank: int, world_size: int) -> str:
    x = torch.zeros(2)
    me = f"worker{rank}"
    nxt, after = f"worker{(rank + 1) % 3}", f"worker{(rank + 2) % 3}"
    # first, while each worker has only its 2 threads (the pool keeps threads it started for
    # blocked waits): a 10-hop chain whose hops wait on futures chained with then()
    assert torch.equal(rpc.rpc_sync(nxt, ring_then_hop, ([me, nxt] * 5, x)), x + 11)
    # a full ring back to the caller: worker0 -> worker1 -> worker2 -> worker0
    out, visited = rpc.rpc_sync(nxt, ring, ([after, me], x, [me]))
    assert torch.equal(out, x + 3), out
    assert visited == [me, nxt, after, me], visited
    # a long chain bouncing between two workers
    out, visited = rpc.rpc_sync(nxt, ring, ([me, nxt] * 5, x, [me]))
    assert torch.equal(out, x + 11) and visited == [me] + [nxt, me] * 5 + [nxt], visited
    # the same chain with every hop waiting on an rpc_async future instead
    assert torch.equal(rpc.rpc_sync(nxt, ring_async_hop, ([me, nxt] * 5, x)), x + 11)
    # many more concurrent nested calls than worker threads (2) on every worker at once
    futures = [rpc.rpc_async(nxt, ring, ([after, me, nxt], x, [me])) for _ in range(12)]
    for fut in futures:
        out, visited = fut.wait()
        assert torch.equal(out, x + 4) and visited == [me, nxt, after, me, nxt], visited
    return "ok"


def test_nested_rings_and_more_concurrent_nested_calls_than_threads() -> None:
    """On 3 workers with 2 worker threads each, every worker at once runs rings back to
    itself (0->1->2->0), 10-hop chains (hops waiting in rpc_sync, on rpc_async futures, or on
    futures chained with then()),
    and 12 concurrent 4-hop nested calls: all complete
    with the right results and paths (torch's agent would deadlock here)."""
    results = run_workers(nested_program, 3, timeout=60, options={"num_worker_threads": 2})
    assert results == {0: "ok", 1: "ok", 2: "ok"}


def async_program(rank: int, world_size: int) -> str:
    if rank != 0:
        return "served"
    x = torch.ones(3)
    assert torch.equal(rpc.rpc_sync("worker1", async_add_then_double, ("worker2", x)), (x + 1) * 2)
    assert torch.equal(
        rpc.rpc_async("worker1", async_add_then_double, ("worker0", x)).wait(), (x + 1) * 2
    )
    assert torch.equal(rpc.rpc_sync("worker1", async_slow_chain, ("worker2", x)), (x + 1) * 10)
    # the decorator is transparent for a local call
    assert torch.equal(async_add_then_double("worker1", x).wait(), (x + 1) * 2)
    # innermost under @staticmethod / @classmethod
    assert torch.equal(rpc.rpc_sync("worker1", AsyncOps.static_add, ("worker2", x)), x + 2)
    assert torch.equal(rpc.rpc_sync("worker1", AsyncOps.class_add, ("worker2", x)), x + 3)
    assert AsyncOps.static_add._wrapped_async_rpc_function is not None  # type: ignore[attr-defined]
    # pending async functions hold no worker thread: 10 of them (0.5 s each) on callees with
    # one worker thread each finish together, not one after another
    started = time.monotonic()
    futures = [rpc.rpc_async("worker1", async_sleepy, ("worker2", x)) for _ in range(10)]
    assert all(torch.equal(f.wait(), x + 1) for f in futures)
    elapsed = time.monotonic() - started
    assert elapsed < 3.0, f"10 pending async functions took {elapsed:.1f}s"
    # a re-entrant chain 0 -> 1 -> 0 -> 1 whose hops wait on rpc_async futures, one worker
    # thread per worker: a waiting hop frees its thread as one in rpc_sync does
    out = rpc.rpc_sync("worker1", ring_async_hop, (["worker0", "worker1"], x), timeout=10)
    assert torch.equal(out, x + 3), out
    return "ok"


def test_async_execution() -> None:
    """With one worker thread per worker: @async_execution functions reply when their Future
    completes (chains with nested calls, from rpc_sync and rpc_async, as static/class
    methods) and hold no worker thread while pending; a re-entrant chain whose hops wait on
    rpc_async futures completes."""
    results = run_workers(
        async_program,
        3,
        timeout=60,
        options={"num_worker_threads": 1},
    )
    assert results == {0: "ok", 1: "served", 2: "served"}


def add_one(x: torch.Tensor) -> torch.Tensor:
    return x + 1


@rpc.functions.async_execution
def chain_waiting_in_callbacks(peers: list[str], x: torch.Tensor) -> torch.futures.Future[Any]:
    """A callback that waits on another call's future (``wait()``) and one that makes an
    ``rpc_sync``: both block a callback thread until other calls complete."""
    return (
        rpc.rpc_async(peers[0], add_one, (x,))
        .then(lambda done: rpc.rpc_async(peers[1], add_one, (done.wait(),)).wait())
        .then(lambda done: rpc.rpc_sync(peers[2], add_one, (done.wait(),)))
    )


@rpc.functions.async_execution
def fan_out_waiting_in_callbacks(peers: list[str], x: torch.Tensor) -> torch.futures.Future[Any]:
    """A fan-out to every peer whose futures are combined by a callback that waits on each
    of them in turn."""
    futures = [rpc.rpc_async(peer, chain_waiting_in_callbacks, (peers, x)) for peer in peers]
    return futures[0].then(lambda done: sum(f.wait() for f in futures))


def callbacks_program(rank: int, world_size: int) -> str:
    peers = [f"worker{(rank + i) % world_size}" for i in range(world_size)]
    x = torch.zeros(2)
    futures = [
        rpc.rpc_async(peers[1 + i % 2], fan_out_waiting_in_callbacks, (peers, x)) for i in range(12)
    ]
    for future in futures:
        assert torch.equal(future.wait(), x + 9)
    return "ok"


def test_callbacks_waiting_on_other_calls_cannot_take_every_callback_thread() -> None:
    """On 3 workers with 2 worker threads (and so 2 callback threads) each, 12 concurrent
    @async_execution fan-outs per worker whose ``then`` callbacks block in ``wait()`` on
    other calls' futures and in ``rpc_sync`` all complete: a callback thread waiting frees
    its slot, as a worker thread does (torch's agent, and distgrad's before, deadlocked once
    the waiting callbacks outnumbered the callback threads)."""
    results = run_workers(callbacks_program, 3, timeout=60, options={"num_worker_threads": 2})
    assert results == {0: "ok", 1: "ok", 2: "ok"}
