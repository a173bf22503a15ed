"""RRefs and ``remote()`` end to end: life cycles across workers, the reference-counting
protocol (owner tables empty at the end), errors and timeouts, proxies, and shutdown."""

from __future__ import annotations

import gc
import os
import pickle
import re
import signal
import threading
import time
from typing import Any

import pytest
import torch

import distgrad.rpc as rpc
from tests._harness import Died, run_workers

pytestmark = pytest.mark.timeout(120)

EMPTY = {"num_owner_rrefs": "0", "num_pending_futures": "0", "num_pending_users": "0",
         "num_forks": "0"}  # fmt: skip


# -- functions the workers call on each other --------------------------------------------------
def make(n: int) -> torch.Tensor:
    return torch.arange(float(n))


def slow_make(seconds: float) -> torch.Tensor:
    time.sleep(seconds)
    return torch.ones(2)


def raise_value_error() -> None:
    raise ValueError("expected error in remote")


def fetch_plus(rref: rpc.RRef[torch.Tensor], k: float) -> torch.Tensor:
    return rref.to_here() + k


def describe(rref: rpc.RRef[Any]) -> tuple[bool, str, bool]:
    """What the receiving worker sees (it runs only once the owner confirmed the RRef)."""
    return rref.is_owner(), rref.owner_name(), rref.confirmed_by_owner()


def identity(obj: Any) -> Any:
    return obj


def forward_to(dst: str, rref: rpc.RRef[torch.Tensor]) -> list[float]:
    """Pass the RRef on to a third worker, which fetches it."""
    return rpc.rpc_sync(dst, fetch_plus, (rref, 0.0)).tolist()  # type: ignore[no-any-return]


def same_object_as_local_value(rref: rpc.RRef[Any], obj_id: int) -> bool:
    return id(rref.local_value()) == obj_id


def settle(seconds: float = 5.0) -> dict[str, str]:
    """This worker's RRef tables once pending protocol messages are done (or as they are)."""
    deadline = time.monotonic() + seconds
    while True:
        gc.collect()
        info = rpc._rref_context_get_debug_info()
        if info == EMPTY or time.monotonic() > deadline:
            return info
        time.sleep(0.05)


def tables_on(rank: int) -> dict[str, str]:
    return rpc.rpc_sync(f"worker{rank}", settle)  # type: ignore[no-any-return]


class Counter:
    def __init__(self, start: float = 0.0) -> None:
        self.value = torch.tensor([start])

    def add(self, k: float) -> torch.Tensor:
        self.value = self.value + k
        return self.value.clone()

    @rpc.functions.async_execution
    def add_later(self, k: float) -> torch.futures.Future[torch.Tensor]:
        future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        threading.Timer(0.05, lambda: future.set_result(self.add(k))).start()
        return future


@rpc.functions.async_execution
def async_make(n: int) -> torch.futures.Future[torch.Tensor]:
    return rpc.rpc_async("worker2", make, (n,))


# -- tests -------------------------------------------------------------------------------------
def life_cycle(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if rank == 0:
        rref = rpc.remote("worker1", make, args=(4,))
        out["user_str"] = str(rref)
        out["to_here"] = rref.to_here().tolist()
        out["owner"] = (rref.owner(), rref.owner_name(), rref.is_owner())
        rref._get_future().wait()  # the creation's reply: the owner has confirmed the user
        out["confirmed"] = rref.confirmed_by_owner()
        # fork to a third worker, which forks it on to a fourth
        out["on2"] = rpc.rpc_sync("worker2", describe, (rref,))
        out["via2to3"] = rpc.rpc_sync("worker2", forward_to, ("worker3", rref))
        # back to the owner: it gets the OwnerRRef
        out["on_owner"] = rpc.rpc_sync("worker1", describe, (rref,))
        # returned from a third worker: a new user
        back = rpc.rpc_sync("worker2", identity, (rref,))
        out["back"] = (back.is_owner(), back.to_here().tolist(), str(back) != str(rref))
        # a local owner RRef sent around and returned to its owner
        value = torch.tensor([7.0])
        local = rpc.RRef(value)
        out["local"] = (str(local).startswith("OwnerRRef("), local.is_owner())
        out["local_fetch"] = rpc.rpc_sync("worker3", fetch_plus, (local, 1.0)).tolist()
        returned = rpc.rpc_sync("worker2", identity, (local,))
        out["local_back"] = (returned.is_owner(), returned.local_value() is value)
        # remote to self: a real call, an owner RRef
        mine = rpc.remote("worker0", make, args=(3,))
        out["self"] = (mine.is_owner(), mine.to_here().tolist(), mine.local_value().tolist())
        del rref, back, local, returned, mine
        out["tables"] = {r: tables_on(r) for r in range(world_size)}
    rpc.api._barrier([f"worker{r}" for r in range(world_size)])
    return out


def test_life_cycle_across_four_workers() -> None:
    """An RRef created by worker0 on worker1 is fetched, forked to worker2 and on to worker3,
    returned to its owner and back from a third worker; a local RRef travels and returns to
    its owner as the very same object; afterwards every worker's tables are empty."""
    out = run_workers(life_cycle, 4, timeout=90)[0]
    assert re.fullmatch(
        r"UserRRef\(RRefId = GloballyUniqueId\(created_on=0, local_id=(\d+)\), "
        r"ForkId = GloballyUniqueId\(created_on=0, local_id=(\d+)\)\)",
        out["user_str"],
    )
    rref_id, fork_id = map(int, re.findall(r"local_id=(\d+)", out["user_str"]))
    assert fork_id == rref_id + 1  # remote() draws the RRef id, then the fork id
    assert out["to_here"] == [0.0, 1.0, 2.0, 3.0]
    assert out["owner"] == (rpc.WorkerInfo("worker1", 1), "worker1", False)
    assert out["confirmed"] is True
    assert out["on2"] == (False, "worker1", True)  # confirmed before the function ran
    assert out["via2to3"] == [0.0, 1.0, 2.0, 3.0]
    assert out["on_owner"] == (True, "worker1", True)
    assert out["back"] == (False, [0.0, 1.0, 2.0, 3.0], True)
    assert out["local"] == (True, True)
    assert out["local_fetch"] == [8.0]
    assert out["local_back"] == (True, True)
    assert out["self"] == (True, [0.0, 1.0, 2.0], [0.0, 1.0, 2.0])
    assert out["tables"] == {r: EMPTY for r in range(4)}


def back_to_owner(rank: int, world_size: int) -> dict[str, Any]:
    """worker0 sends its UserRRef to the owner in 50 calls (the batch RL agent's pattern)."""
    from distgrad._rpc._core._agent import current_agent
    from distgrad._rpc._rrefs._rref_context import context_of

    out: dict[str, Any] = {}
    if rank == 0:
        value_id = rpc.rpc_sync("worker1", _new_counter_id)
        rref = rpc.remote("worker1", _the_counter)
        out["same"] = all(
            rpc.rpc_sync("worker1", same_object_as_local_value, (rref, value_id)) for _ in range(50)
        )
        agent = current_agent()
        assert agent is not None
        pending = context_of(agent)._pending_children
        deadline = time.monotonic() + 10
        while pending and time.monotonic() < deadline:
            time.sleep(0.01)
        out["pending_children"] = len(pending)
        del rref
        out["tables"] = {r: tables_on(r) for r in range(world_size)}
    rpc.api._barrier([f"worker{r}" for r in range(world_size)])
    return out


_COUNTERS: list[Counter] = []


def _new_counter_id() -> int:
    _COUNTERS.append(Counter())
    return id(_COUNTERS[-1])


def _the_counter() -> Counter:
    return _COUNTERS[-1]


def test_user_rref_sent_back_to_its_owner_again_and_again() -> None:
    """A user that passes its RRef to the owner in every call (as the batch RL example's
    observers do) reaches the very owner object each time; the owner's one-way notices let
    the user drop every child it held, and the tables are empty once the RRef is gone."""
    out = run_workers(back_to_owner, 2, timeout=60)[0]
    assert out["same"] is True
    assert out["pending_children"] == 0
    assert out["tables"] == {r: EMPTY for r in range(2)}


def errors_and_rules(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if rank != 0:
        return out
    failing = rpc.remote("worker1", raise_value_error)
    with pytest.raises(ValueError, match="expected error in remote") as info:
        failing.to_here()
    out["remote_traceback"] = "raise_value_error" in str(info.value)
    del info  # its traceback's frames hold the RRef
    # the error also surfaces where the RRef is used by a third worker
    with pytest.raises(ValueError, match="expected error in remote"):
        rpc.rpc_sync("worker2", fetch_plus, (failing, 1.0))
    user = rpc.remote("worker1", make, args=(2,))
    with pytest.raises(
        RuntimeError,
        match=re.escape(
            f"For UserRRef(rref_id={user._rref_id!r}, fork_id={user._fork_id!r}), can't call "
            "localValue() on user WorkerInfo(id=0, name=worker0). Call it on owner "
            "WorkerInfo(id=1, name=worker1)"
        ),
    ):
        user.local_value()
    msg = "Can not pickle rref in python pickler, rref can only be pickled when using RPC"
    with pytest.raises(RuntimeError, match=msg):
        pickle.dumps(user)
    with pytest.raises(RuntimeError, match=msg):
        torch.save(rpc.RRef(torch.ones(1)), os.devnull)
    with pytest.raises(RuntimeError, match="User RRefs require 'dist_autograd_ctx_id'"):
        user.backward()
    with pytest.raises(
        RuntimeError, match=re.escape("RRef should contain a tensor for .backward()")
    ):
        rpc.RRef("not a tensor").backward()
    with pytest.raises(TypeError, match=re.escape("function should be callable.")):
        rpc.remote("worker1", 3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="Cannot get WorkerInfo from name"):
        rpc.remote(1.5, make, (1,))  # type: ignore[arg-type]
    out["type"] = (user._get_type(), user._get_type(blocking=False).wait())
    out["builtin"] = rpc.remote("worker1", torch.add, args=(torch.ones(2), 2)).to_here().tolist()
    out["async"] = rpc.remote("worker1", async_make, args=(3,)).to_here().tolist()
    out["kwargs"] = rpc.remote("worker2", Counter, kwargs={"start": 5.0}).rpc_sync().add(1.0)
    del failing, user
    out["tables"] = {r: tables_on(r) for r in range(world_size)}
    return out


def test_errors_types_and_reference_rules() -> None:
    """An exception raised in remote() keeps its type and traceback wherever the RRef is
    used; local_value on a user, pickling outside RPC, user backward without a context and
    backward of a non-tensor fail with the reference's messages; builtins, async functions and
    kwargs work through remote(); _get_type is the value's type."""
    out = run_workers(errors_and_rules, 3, timeout=90)[0]
    assert out["remote_traceback"]
    assert out["type"] == (torch.Tensor, torch.Tensor)
    assert out["builtin"] == [3.0, 3.0]
    assert out["async"] == [0.0, 1.0, 2.0]
    assert out["kwargs"].tolist() == [6.0]
    assert out["tables"] == {r: EMPTY for r in range(3)}


def rref_before_init() -> None:
    with pytest.raises(RuntimeError, match="Current RPC agent is not set! Did you initialize"):
        rpc.RRef(torch.ones(1))


def test_rref_before_init_rpc() -> None:
    """RRef(value) before init_rpc raises the reference's error."""
    rref_before_init()


def proxies(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if rank == 0:
        counter = rpc.remote("worker1", Counter)
        out["sync"] = counter.rpc_sync().add(1.0).tolist()
        out["async"] = counter.rpc_async().add(2.0).wait().tolist()
        out["remote"] = counter.remote().add(3.0).to_here().tolist()
        out["async_exec_sync"] = counter.rpc_sync().add_later(4.0).tolist()
        out["async_exec_async"] = counter.rpc_async().add_later(5.0).wait().tolist()
        with pytest.raises(AttributeError, match="no attribute 'missing'"):
            counter.rpc_sync().missing()
        pending = counter.rpc_async().missing()
        with pytest.raises(AttributeError, match="no attribute 'missing'"):
            pending.wait()
        local = rpc.RRef(Counter(10.0))
        out["local_proxy"] = local.rpc_sync().add(1.0).tolist()
        out["identity"] = (
            rpc.rpc_sync("worker1", same_object_as_local_value, (counter, id(None))) is False
        )
        del counter, local, pending
        out["tables"] = {r: tables_on(r) for r in range(world_size)}
    rpc.api._barrier([f"worker{r}" for r in range(world_size)])
    return out


def test_proxies() -> None:
    """rref.rpc_sync()/rpc_async()/remote() run methods on the owner (async_execution methods
    too); unknown methods raise AttributeError (at the call, or from wait() for rpc_async)."""
    out = run_workers(proxies, 2, timeout=60)[0]
    assert out["sync"] == [1.0]
    assert out["async"] == [3.0]
    assert out["remote"] == [6.0]
    assert out["async_exec_sync"] == [10.0]
    assert out["async_exec_async"] == [15.0]
    assert out["local_proxy"] == [11.0]
    assert out["tables"] == {r: EMPTY for r in range(2)}


def timeouts(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if rank != 0:
        return out
    creation = "RRef creation via rpc.remote() timed out, and it is possible that the RRef on"
    late = rpc.remote("worker1", slow_make, args=(1.5,), timeout=0.3)
    with pytest.raises(RuntimeError, match="RPC ran for more than set timeout"):
        late._get_future().wait()
    with pytest.raises(RuntimeError, match=re.escape(creation)):
        late.to_here()
    with pytest.raises(RuntimeError, match=re.escape(creation)):
        rpc.rpc_sync("worker1", fetch_plus, (late, 1.0))
    slow_value = rpc.remote("worker1", slow_make, args=(1.0,))
    with pytest.raises(RuntimeError, match="RPC ran for more than set timeout"):
        slow_value.to_here(timeout=0.2)
    out["eventually"] = slow_value.to_here(timeout=10).tolist()
    return out


def test_creation_and_fetch_timeouts() -> None:
    """A remote() that outlives its timeout makes to_here and forks raise the reference's
    creation-timeout error and _get_future() the timeout error; a to_here timeout fails only
    that fetch."""
    out = run_workers(timeouts, 2, timeout=60)[0]
    assert out["eventually"] == [1.0, 1.0]


def die_soon(delay: float) -> None:
    timer = threading.Timer(delay, os.kill, (os.getpid(), signal.SIGKILL))
    timer.daemon = True
    timer.start()


def die_with_value(rank: int, world_size: int) -> dict[str, Any] | str:
    if rank == 1:
        time.sleep(60)  # killed long before
        return "unreachable"
    rref = rpc.remote("worker1", slow_make, args=(30.0,))
    time.sleep(0.3)
    rpc.rpc_sync("worker1", die_soon, (0.3,))
    started = time.monotonic()
    with pytest.raises(rpc.PeerFailureError, match="worker1"):
        rref.to_here(timeout=0)
    waited = time.monotonic() - started
    with pytest.raises(rpc.PeerFailureError, match="worker1"):
        rpc.remote("worker1", make, (1,)).to_here()
    rpc.shutdown(graceful=False)
    return {"waited": waited}


def test_killed_owner_fails_to_here_fast() -> None:
    """When the owner is SIGKILLed, a to_here waiting on it (no timeout) fails within the
    failure-detection bound with an error naming it; new remote() calls to it fail at once."""
    results = run_workers(die_with_value, 2, timeout=60, shutdown=False, may_die={1})
    assert results[1] == Died(-signal.SIGKILL)
    assert isinstance(results[0], dict) and results[0]["waited"] < 5.0


def soak(rank: int, world_size: int, rounds: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if rank == 0:
        total = 0.0
        for i in range(rounds):
            owner = f"worker{1 + i % (world_size - 1)}"
            third = f"worker{1 + (i + 1) % (world_size - 1)}"
            rref = rpc.remote(owner, make, args=(3,))
            if i % 3 == 0:
                total += float(rpc.rpc_sync(third, fetch_plus, (rref, 1.0)).sum())
            elif i % 3 == 1:
                total += float(rpc.rpc_sync(third, identity, (rref,)).to_here().sum())
            else:
                total += float(rref.to_here().sum())
            del rref
        out["total"] = total
        out["tables"] = {r: tables_on(r) for r in range(world_size)}
    rpc.api._barrier([f"worker{r}" for r in range(world_size)])
    return out


def test_soak_owner_tables_return_to_empty() -> None:
    """Creating, forking and dropping many RRefs leaves every owner's tables empty."""
    rounds = int(os.environ.get("DISTGRAD_RREF_SOAK", "300"))
    out = run_workers(soak, 3, timeout=110, kwargs={"rounds": rounds})[0]
    expected = sum(6.0 if i % 3 == 0 else 3.0 for i in range(rounds))
    assert out["total"] == expected
    assert out["tables"] == {r: EMPTY for r in range(3)}


def use_after_shutdown(rank: int, world_size: int) -> dict[str, Any]:
    rpc.api._ignore_rref_leak = False  # the leak check must find nothing
    rref = rpc.remote(f"worker{(rank + 1) % world_size}", make, args=(2,))
    held = rpc.RRef(torch.ones(1))
    rpc.rpc_sync(f"worker{(rank + 1) % world_size}", identity, (held,))
    rpc.shutdown()
    with pytest.raises(
        RuntimeError, match=re.escape("Cannot call to_here() on it after deletion.")
    ):
        rref.to_here()
    return {"str": str(rref)}


def test_graceful_shutdown_deletes_users() -> None:
    """Graceful shutdown deletes every user (the leak check, switched on, finds nothing);
    a UserRRef used afterwards raises the reference's deletion error."""
    out = run_workers(use_after_shutdown, 3, timeout=60, shutdown=False)
    assert all(o["str"].startswith("UserRRef(") for o in out.values())


# -- remote() requests that fail before their function runs (issue 14, F2) -------------------
def _rebuild_only_in(pid: int) -> FailsElsewhere:
    if os.getpid() != pid:
        raise ValueError("cannot rebuild here")
    return FailsElsewhere()


class FailsElsewhere:
    """Pickles fine; unpickling it in any other process raises ValueError."""

    def __init__(self) -> None:
        self.pid = os.getpid()

    def __reduce__(self) -> Any:
        return (_rebuild_only_in, (self.pid,))


def bounded(fn: Any, seconds: float) -> tuple[str, float]:
    """Run ``fn`` in a thread; ``(outcome, elapsed)``: the error's type and message, or
    ``"hung"`` if it did not return within ``seconds``."""
    outcome: list[str] = []

    def run() -> None:
        try:
            outcome.append(f"returned {fn()!r}")
        except Exception as exc:
            outcome.append(f"{type(exc).__name__}: {exc}")

    started = time.monotonic()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    return (outcome[0] if outcome else "hung"), time.monotonic() - started


def unpicklable_argument(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if rank == 0:
        rref = rpc.remote("worker1", identity, args=(FailsElsewhere(),))
        out["at_once"] = bounded(lambda: rref.to_here(timeout=0), 10.0)
        rref._get_future().wait()  # the creation is answered: the error is the value's
        out["again"] = bounded(lambda: rref.to_here(timeout=0), 10.0)
        mine = rpc.remote("worker0", identity, args=(FailsElsewhere(),))  # to self: fine
        out["self"] = type(mine.to_here()).__name__
        del rref, mine
        out["tables"] = {r: tables_on(r) for r in range(world_size)}
    rpc.api._barrier([f"worker{r}" for r in range(world_size)])
    return out


def test_remote_with_unpicklable_argument_fails_at_once() -> None:
    """remote() with an argument that fails to unpickle on the owner: to_here(timeout=0),
    sent before and after the creation is answered, raises that error at once (not a
    timeout, not a hang), owner tables end empty and graceful shutdown returns."""
    out = run_workers(unpicklable_argument, 2, timeout=60)[0]
    for key in ("at_once", "again"):
        outcome, elapsed = out[key]
        assert outcome.startswith("RuntimeError"), outcome
        assert "could not unpickle the request: ValueError('cannot rebuild here')" in outcome
        assert elapsed < 5.0
    assert out["self"] == "FailsElsewhere"
    assert out["tables"] == {r: EMPTY for r in range(2)}


def rref_argument_of_dead_owner(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if rank == 2:
        time.sleep(60)  # killed long before
    if rank == 0:
        doomed = rpc.remote("worker2", make, args=(2,))
        doomed.to_here()
        rpc.rpc_sync("worker2", die_soon, (0.1,))
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # until worker0 knows worker2 is gone
            try:
                rpc.rpc_sync("worker2", make, (1,), timeout=1)
            except rpc.PeerFailureError:
                break
            time.sleep(0.1)
        rref = rpc.remote("worker1", fetch_plus, args=(doomed, 1.0))
        out["outcome"] = bounded(lambda: rref.to_here(timeout=0), 15.0)
        del rref
    rpc.api._barrier(["worker0", "worker1"])
    rpc.shutdown(graceful=False)
    return out


def test_remote_with_rref_argument_of_dead_owner_fails_at_once() -> None:
    """remote() whose RRef argument's owner died: the owner of the new value fails it with
    the dead owner's PeerFailureError, so to_here(timeout=0) raises that at once."""
    results = run_workers(rref_argument_of_dead_owner, 3, timeout=60, shutdown=False, may_die={2})
    assert results[2] == Died(-signal.SIGKILL)
    outcome, elapsed = results[0]["outcome"]
    assert outcome.startswith("PeerFailureError") and "worker2" in outcome, outcome
    assert elapsed < 10.0
