"""The RRef protocol as a state machine under injected faults, on in-memory worlds.

Table-driven: worker0 creates an RRef owned by worker1 (``remote``), passes it to worker2 (a
fork: worker2 asks the owner to register it, then tells worker0 the child is accepted), and
fetches the value; then every user lets go (deletes). Each case injects one fault into one
kind of protocol message, or kills the owner at one step, and asserts the outcome -- the
right values, or a clear error -- and that afterwards every live worker's RRef tables are
empty: no owner value, no fork, no pending user, child or control message."""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

import distgrad.rpc as rpc
from distgrad._rpc._rrefs._rref_context import context_of
from distgrad.testing import Fault, World, open_world, world_options

#: a lost control message is retried after the RPC timeout (as torch's sendWithRetries)
OPTIONS = dict(rpc_timeout=1.0, heartbeat_interval=0.1, peer_timeout=2.0)
EMPTY = {
    "num_owner_rrefs": "0",
    "num_pending_futures": "0",
    "num_pending_users": "0",
    "num_forks": "0",
}


def make_value(n: int) -> torch.Tensor:
    return torch.arange(float(n))


def fetch_sum(rref: rpc.RRef[torch.Tensor]) -> float:
    return float(rref.to_here().sum())


def scenario(rank: int) -> tuple[str, object]:
    """worker0's part: create, fork to worker2, fetch; ("ok", values) or ("error", message)."""
    if rank != 0:
        return ("ok", None)
    try:
        rref = rpc.remote("worker1", make_value, args=(4,))
        forked = rpc.rpc_sync("worker2", fetch_sum, args=(rref,))
        direct = rref.to_here().tolist()
    except RuntimeError as exc:
        return ("error", str(exc))
    return ("ok", (forked, direct))


EXPECTED = (6.0, [0.0, 1.0, 2.0, 3.0])


@dataclass(frozen=True)
class Case:
    fault: Fault
    outcome: str  # "ok" or "error"
    match: str = ""


def _cases() -> dict[str, Case]:
    cases: dict[str, Case] = {}
    control = ["RREF_FORK_REQUEST", "RREF_CHILD_ACCEPT", "RREF_USER_DELETE", "RREF_ACK"]
    timeout = "RPC ran for more than"
    for kind in control:
        # Control messages are idempotent and retried; a failed send at once, a lost one after
        # the RPC timeout -- by when a call waiting for the fork's confirmation has timed out
        # (as in torch). Either way the protocol completes: the tables end up empty.
        waits = kind in ("RREF_FORK_REQUEST", "RREF_ACK")
        cases[f"{kind}-dropped"] = Case(
            Fault("drop", type=kind, nth=1), "error" if waits else "ok", timeout
        )
        failed = Fault("fail", type=kind, times=2)
        # (a response cannot fail to send as a request does: it is lost, as when dropped)
        cases[f"{kind}-failed"] = Case(failed, "error" if kind == "RREF_ACK" else "ok", timeout)
        cases[f"{kind}-duplicated"] = Case(Fault("duplicate", type=kind), "ok")
        cases[f"{kind}-delayed"] = Case(Fault("delay", type=kind, seconds=0.05), "ok")
        cases[f"{kind}-reordered"] = Case(Fault("reorder", type=kind, nth=1, hold=0.05), "ok")
    creation = "RRef creation via rpc.remote() timed out"
    # the fork reaches the owner, whose fetch then waits for a value that never comes
    cases["creation-dropped"] = Case(Fault("drop", type="PYTHON_REMOTE_CALL"), "error", timeout)
    cases["creation-failed"] = Case(Fault("fail", type="PYTHON_REMOTE_CALL"), "error", creation)
    cases["creation-delayed"] = Case(Fault("delay", type="PYTHON_REMOTE_CALL", seconds=0.05), "ok")
    # the value exists: the fork and the fetches work before the creation call times out
    cases["creation-answer-dropped"] = Case(Fault("drop", type="REMOTE_RET"), "ok")
    cases["creation-answer-delayed"] = Case(Fault("delay", type="REMOTE_RET", seconds=0.05), "ok")
    cases["fetch-dropped"] = Case(
        Fault("drop", type="PYTHON_RREF_FETCH_CALL", src=0), "error", "RPC ran for more than"
    )
    cases["fetch-answer-delayed"] = Case(
        Fault("delay", type="PYTHON_RREF_FETCH_RET", seconds=0.05), "ok"
    )
    return cases


CASES = _cases()
#: known failures (strict: fixed means the mark goes)
XFAIL: dict[str, str] = {}


def _tables(world: World) -> dict[int, dict[str, str]]:
    gc.collect()  # RRefs in reference cycles (tracebacks) are dropped now, not some day
    return {rank: context_of(world.agents[rank]).debug_info() for rank in world.alive()}


def _wait_empty(world: World, bound: float = 8.0) -> dict[int, dict[str, str]]:
    """Wait (bounded) until every live worker's tables are empty; return the last state."""
    deadline = time.monotonic() + bound
    tables = _tables(world)
    while any(t != EMPTY for t in tables.values()) and time.monotonic() < deadline:
        time.sleep(0.05)
        tables = _tables(world)
    return tables


def _run(case: Case, kill: int | None = None) -> None:
    world_box: list[World] = []
    fault = case.fault
    if kill is not None:

        def fire() -> None:
            threading.Thread(target=world_box[0].kill, args=(kill,), daemon=True).start()

        fault = Fault(fault.action, type=fault.type, function=fault.function, nth=1, on_fire=fire)
    with open_world(3, options=world_options(**OPTIONS), faults=[fault], timeout=15) as world:
        world_box.append(world)
        status, value = world.run(scenario)[0]
        if case.outcome == "ok":
            assert (status, value) == ("ok", EXPECTED)
        else:
            assert status == "error", value
            assert case.match in str(value), value
        tables = _wait_empty(world)
        # (after the wait: deletes go out once the users are collected, maybe after run())
        assert world.faults is not None and world.faults.fired(), "the fault never fired"
        assert all(t == EMPTY for t in tables.values()), tables


@pytest.mark.parametrize(
    "case_name",
    [
        pytest.param(n, marks=pytest.mark.xfail(strict=True, reason=XFAIL[n])) if n in XFAIL else n
        for n in sorted(CASES)
    ],
)
def test_rref_protocol_under_a_message_fault(case_name: str) -> None:
    """One fault on one kind of RRef message: the values or a clear error, and empty tables on
    every worker afterwards."""
    _run(CASES[case_name])


OWNER_DIES: dict[str, Callable[[], Case]] = {
    "at-creation": lambda: Case(Fault("drop", type="PYTHON_REMOTE_CALL"), "error", "worker1"),
    "at-fork-request": lambda: Case(Fault("drop", type="RREF_FORK_REQUEST"), "error", "worker1"),
    "at-fetch": lambda: Case(Fault("drop", type="PYTHON_RREF_FETCH_CALL"), "error", "worker1"),
}


@pytest.mark.parametrize("step", sorted(OWNER_DIES))
def test_rref_protocol_when_the_owner_dies(step: str) -> None:
    """The owner dies as a protocol message is sent to it: the users get a clear error and
    keep nothing of that RRef."""
    _run(OWNER_DIES[step](), kill=1)


def test_deletes_for_a_suspected_owner_arrive_when_it_is_back() -> None:
    """The owner is frozen past peer_timeout while its user lets go of the RRef, and the
    delete's first two attempts are lost: the delete fails on suspicion, is retried while the
    owner is only suspected, and reaches it once it thaws -- the owner's tables end empty
    (before, the delete was given up and the owner kept the value until shutdown)."""
    world_box: list[World] = []

    def body(rank: int) -> object:
        if rank != 0:
            return None
        rref = rpc.remote("worker1", make_value, args=(4,))
        value = rref.to_here().tolist()
        plan = world_box[0].faults
        assert plan is not None
        plan.freeze(1)
        del rref
        gc.collect()
        time.sleep(OPTIONS["peer_timeout"] + 1.5)  # suspected, with the delete failing
        plan.thaw(1)
        return value

    lost = Fault("drop", type="RREF_USER_DELETE", times=2)
    with open_world(3, options=world_options(**OPTIONS), faults=[lost], timeout=20) as world:
        world_box.append(world)
        assert world.run(body)[0] == [0.0, 1.0, 2.0, 3.0]
        tables = _wait_empty(world)
        assert all(t == EMPTY for t in tables.values()), tables
