"""RPC calls between real worker processes over 127.0.0.1: every worker calls every worker."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import distgrad.rpc as rpc
from tests._harness import run_workers

pytestmark = pytest.mark.timeout(90)


# -- functions the workers run for each other --------------------------------------------------
def combine(a: object, b: object = 0, *, scale: int = 1) -> object:
    return (a + b) * scale  # type: ignore[operator]


def slow_combine(a: object, b: object = 0) -> object:
    time.sleep(0.3)  # still pending when the caller attaches its callback
    return combine(a, b)


def where_am_i(tag: object) -> tuple[str, int, object]:
    """Which worker, and which thread, ran this."""
    return rpc.get_worker_info().name, threading.get_ident(), tag


def mutate(x: torch.Tensor) -> torch.Tensor:
    x.add_(100)
    return x


def slow_identity(x: object, seconds: float) -> object:
    time.sleep(seconds)
    return x


def all_to_all(rank: int, world_size: int) -> int:
    me = rpc.get_worker_info()
    assert me == rpc.WorkerInfo(f"worker{rank}", rank), me
    assert rpc.get_worker_info(f"worker{rank}") == me
    calls = 0
    for peer in range(world_size):
        info = rpc.get_worker_info(f"worker{peer}")
        assert info == rpc.WorkerInfo(f"worker{peer}", peer), info
        for to in (f"worker{peer}", peer, info):
            x = torch.full((3,), float(rank))
            # builtin operator, positional args and kwargs
            assert torch.equal(rpc.rpc_sync(to, torch.add, (x, peer)), x + peer)
            got = rpc.rpc_async(to, torch.add, (x, torch.ones(3)), {"alpha": 2}).wait()
            assert torch.equal(got, x + 2), got
            # Python function, args and kwargs, sync and async
            assert rpc.rpc_sync(to, combine, (rank, peer), {"scale": 3}) == (rank + peer) * 3
            assert rpc.rpc_sync(to, combine, kwargs={"a": "x", "b": "y"}) == "xy"
            assert torch.equal(rpc.rpc_async(to, combine, (x,), {"b": x}).wait(), 2 * x)
            assert rpc.rpc_sync(to, combine, args=[rank, 1]) == rank + 1
            # it ran on the worker named by ``to``
            name, _thread, tag = rpc.rpc_sync(to, where_am_i, ((rank, peer),))
            assert (name, tag) == (f"worker{peer}", (rank, peer)), (name, tag)
            name, _thread, _ = rpc.rpc_async(to, where_am_i, (None,)).wait()
            assert name == f"worker{peer}"
            calls += 8
    return calls


def test_every_worker_calls_every_worker() -> None:
    """4 workers each call all 4 (themselves included) with builtins and Python functions,
    positional args and kwargs, rpc_sync and rpc_async, and ``to`` given as name, rank and
    WorkerInfo; every result is right and every call ran on the worker it was sent to."""
    results = run_workers(all_to_all, 4, timeout=60)
    assert results == {r: 4 * 3 * 8 for r in range(4)}


def self_calls(rank: int, world_size: int) -> str:
    x = torch.zeros(3)
    # RPC to self is a real RPC: arguments are copies and it runs on a server thread
    out = rpc.rpc_sync(rpc.get_worker_info(), mutate, (x,))
    assert torch.equal(out, torch.full((3,), 100.0)), out
    assert torch.equal(x, torch.zeros(3)), "the callee mutated the caller's tensor"
    _name, thread, _ = rpc.rpc_sync(f"worker{rank}", where_am_i, (0,))
    assert thread != threading.get_ident()
    # the same holds for a peer
    y = torch.zeros(2)
    assert torch.equal(rpc.rpc_sync(f"worker{1 - rank}", mutate, (y,)), torch.full((2,), 100.0))
    assert torch.equal(y, torch.zeros(2))
    # concurrent async calls to one peer all complete with their own results
    futures = [rpc.rpc_async(f"worker{1 - rank}", slow_identity, (i, 0.01)) for i in range(50)]
    assert [f.wait() for f in futures] == list(range(50))
    # _wait_all collects the futures of the block and waits for all of them
    with rpc._wait_all():
        collected = [rpc.rpc_async(f"worker{1 - rank}", slow_identity, (i, 0.2)) for i in range(3)]
        assert not any(f.done() for f in collected)
    assert all(f.done() for f in collected)
    assert [f.value() for f in collected] == [0, 1, 2]
    # futures made outside a block are not waited for by a later block
    outside = rpc.rpc_async(f"worker{1 - rank}", slow_identity, ("late", 1.0))
    with rpc._wait_all():
        inside = rpc.rpc_async(f"worker{1 - rank}", slow_identity, ("quick", 0.0))
    assert inside.done() and not outside.done()
    assert outside.wait() == "late"
    # callbacks on futures run off the I/O thread and may make RPCs themselves
    chained = rpc.rpc_async(f"worker{1 - rank}", combine, (1, 2)).then(
        lambda fut: rpc.rpc_sync(f"worker{1 - rank}", combine, (fut.wait(), 10))
    )
    assert chained.wait() == 13
    # the group helpers
    gathered = rpc.api._all_gather(rank * 10)
    assert gathered == {"worker0": 0, "worker1": 10}, gathered
    rpc.api._barrier(["worker0", "worker1"])
    return from_many_threads(rank, world_size)


def test_self_calls_copies_wait_all_and_callbacks() -> None:
    """RPC to self is a real RPC (copied arguments, another thread); 50 concurrent calls each
    get their own result; ``_wait_all`` waits for exactly the futures of its block;
    ``then`` callbacks may make RPCs; ``_all_gather`` and ``_barrier`` work; 8 threads on each
    worker make 40 interleaved sync/async calls each, all with their own results; a callback
    blocked on a future does not hold up later calls."""
    assert run_workers(self_calls, 2, timeout=60) == {0: "ok", 1: "ok"}


def from_many_threads(rank: int, world_size: int) -> str:
    peer = f"worker{1 - rank}"
    errors: list[BaseException] = []

    def caller(t: int) -> None:
        try:
            for i in range(40):
                x = torch.full((4,), float(t * 1000 + i))
                if i % 2:
                    got = rpc.rpc_sync(peer, combine, (x, 1))
                else:
                    got = rpc.rpc_async(peer, combine, (x,), {"b": 1}).wait()
                assert torch.equal(got, x + 1), (t, i, got)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=caller, args=(t,)) for t in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors, errors[:3]
    # a slow callback does not hold up other calls: callbacks run off the I/O thread
    release = threading.Event()
    # (the call must still be pending when ``then`` is attached, or the callback runs inline)
    pending = rpc.rpc_async(peer, slow_combine, (1, 1))
    slow = pending.then(lambda fut: release.wait(10) and fut.wait())
    assert not pending.done()
    started = time.monotonic()
    for _ in range(20):
        assert rpc.rpc_sync(peer, combine, (2, 2)) == 4
    assert rpc.rpc_async(peer, combine, (3, 3)).wait() == 6
    took = time.monotonic() - started
    release.set()
    assert slow.wait() == 2
    assert took < 2.0, f"calls took {took:.2f}s while a callback was blocked"
    return "ok"


def wait_all_on_error(rank: int, world_size: int) -> str:
    if rank != 0:
        return "served"
    with pytest.raises(ValueError, match="inside the block"), rpc._wait_all():
        fut = rpc.rpc_async("worker1", slow_identity, ("late", 0.5))
        raise ValueError("inside the block")
    assert fut.done(), "_wait_all did not wait for its futures when the block raised"
    return "ok"


def test_wait_all_waits_even_when_the_block_raises() -> None:
    """Like torch's, ``_wait_all`` waits for the block's futures also when the block raises."""
    assert run_workers(wait_all_on_error, 2, timeout=60) == {0: "ok", 1: "served"}


# -- each call runs once, whichever thread reads it ---------------------------------------------
_bumps = [0]
_bumps_lock = threading.Lock()


def bump(n: int) -> int:
    with _bumps_lock:
        _bumps[0] += 1
    return n


def bumps() -> int:
    with _bumps_lock:
        return _bumps[0]


def calls_run_once(rank: int, world_size: int) -> tuple[int, int]:
    """Lean calls (sync, async in bursts), general-path calls (a tensor argument, inside an
    autograd context whose cleanup reaches a lingering worker between two calls) and calls
    after pauses longer than lingering, to one worker; how many it ran, how many were sent."""
    import distgrad.autograd as dist_autograd

    if rank != 0:
        return (0, 0)
    sent = 0
    for i in range(200):
        rpc.rpc_sync("worker1", bump, (i,))
        sent += 1
        if i % 10 == 0:
            futures = [rpc.rpc_async("worker1", bump, (j,)) for j in range(20)]
            torch.futures.wait_all(futures)
            sent += 20
        if i % 7 == 0:
            with dist_autograd.context():
                rpc.rpc_sync("worker1", bump, (torch.ones(2, requires_grad=True),))
            sent += 1
        if i % 50 == 0:
            time.sleep(0.01)  # (past the 2 ms a worker lingers)
    return (rpc.rpc_sync("worker1", bumps), sent)


def test_each_call_runs_once_whichever_thread_reads_it() -> None:
    """The function of every request runs exactly once on the callee -- whether the request
    was read by the I/O thread, a caller reading its own answer, or a worker lingering on the
    connection (which also hands on the context cleanups it reads) -- on the lean path and the
    general one: the count of runs equals the count of calls (torch runs each once)."""
    results = run_workers(calls_run_once, 2)
    ran, sent = results[0]
    assert sent == 200 + 20 * 20 + 29
    assert ran == sent
