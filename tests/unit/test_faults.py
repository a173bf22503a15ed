"""Unit tests of fault injection (``distgrad._transport._faulty``, ``distgrad.testing``, the
``FAULTY_TENSORPIPE`` options): each action does what it says to the chosen messages only."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import distgrad.rpc as rpc
import distgrad.rpc._testing as rpc_testing
from distgrad._errors import InjectedFailureError, PeerFailureError, RpcTimeoutError
from distgrad._rpc._rrefs._rref_context import context_of
from distgrad._transport._base import MessageInfo
from distgrad.testing import Fault, FaultPlan, current_fault_plan, open_world, world_options

_seen: list[str] = []
_seen_lock = threading.Lock()


def record(tag: str) -> str:
    with _seen_lock:
        _seen.append(tag)
    return tag


def add(a: int, b: int) -> int:
    return a + b


def call(
    info_type: str = "PYTHON_CALL", function: str = "tests.unit.test_faults.add"
) -> MessageInfo:
    return MessageInfo(info_type, function)


# -- choosing messages (pure) ----------------------------------------------------------------------
def test_a_rule_matches_on_every_field_it_gives() -> None:
    """type (or the autograd wrapper's type), function (full or last part), src, dst."""
    info = MessageInfo("PYTHON_CALL", "pkg.mod.add", True, "FORWARD_AUTOGRAD_REQ")
    assert Fault("drop").matches(0, 1, info)
    assert Fault("drop", type="PYTHON_CALL").matches(0, 1, info)
    assert Fault("drop", type="FORWARD_AUTOGRAD_REQ").matches(0, 1, info)
    assert not Fault("drop", type="SCRIPT_CALL").matches(0, 1, info)
    assert Fault("drop", function="add").matches(0, 1, info)
    assert Fault("drop", function="mod.add").matches(0, 1, info)
    assert not Fault("drop", function="dd").matches(0, 1, info)
    assert Fault("drop", src=0, dst=1).matches(0, 1, info)
    assert not Fault("drop", src=1).matches(0, 1, info)
    assert not Fault("drop", dst=0).matches(0, 1, info)


def test_nth_and_times_count_matching_messages_only() -> None:
    """nth picks the n-th match, times the first n; messages that do not match do not count."""
    plan = FaultPlan([Fault("drop", type="PYTHON_CALL", nth=2), Fault("delay", times=1)])
    other = MessageInfo("RREF_USER_DELETE", "x")
    actions = [
        [f.action for f in plan.decide(0, 1, info, b"")] for info in (other, call(), call(), call())
    ]
    assert actions == [["delay"], [], ["drop"], []]
    assert [a.action for a in plan.fired()] == ["delay", "drop"]


def test_torch_options_fail_each_distinct_message_num_fail_sends_times() -> None:
    """messages_to_fail with num_fail_sends: a message (by its bytes) fails that many times,
    then goes through -- so a retried control message eventually succeeds, as in torch."""
    plan = FaultPlan(messages_to_fail=["RREF_USER_DELETE"], num_fail_sends=2)
    delete = MessageInfo("RREF_USER_DELETE", "f")
    outcomes = [
        [f.action for f in plan.decide(0, 1, delete, meta)] for meta in (b"a", b"a", b"b", b"a")
    ]
    assert outcomes == [["fail"], ["fail"], ["fail"], []]
    assert plan.decide(0, 1, call(), b"a") == []


def test_fault_arguments_are_checked() -> None:
    """Unknown actions, nth 0 and negative delays are refused with a clear error."""
    with pytest.raises(ValueError, match="unknown fault action 'explode'"):
        Fault("explode")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="nth counts from 1"):
        Fault("drop", nth=0)
    with pytest.raises(ValueError, match="delays must not be negative"):
        Fault("delay", seconds=-1)


# -- torch's options -------------------------------------------------------------------------------
def test_faulty_backend_is_registered_as_torchs() -> None:
    """Importing distgrad.rpc._testing registers FAULTY_TENSORPIPE; its options builder takes
    torch's arguments and checks them with torch's messages."""
    backend = rpc.backend_registry.BackendType["FAULTY_TENSORPIPE"]
    assert backend is rpc.BackendType.FAULTY_TENSORPIPE
    options = rpc.backend_registry.construct_rpc_backend_options(
        backend,
        init_method="tcp://127.0.0.1:1",
        num_worker_threads=8,
        num_fail_sends=3,
        messages_to_fail=["RREF_FORK_REQUEST", "RREF_CHILD_ACCEPT"],
        messages_to_delay={"PYTHON_CALL": 1.5},
    )
    assert isinstance(options, rpc_testing.FaultyTensorPipeRpcBackendOptions)
    assert (options.num_worker_threads, options.num_fail_sends) == (8, 3)
    assert set(options.messages_to_fail) == {"RREF_FORK_REQUEST", "RREF_CHILD_ACCEPT"}
    assert options.messages_to_delay == {"PYTHON_CALL": 1.5}
    assert options.rpc_timeout == rpc.constants.DEFAULT_RPC_TIMEOUT_SEC
    with pytest.raises(RuntimeError, match="numFailSends should be non-negative"):
        rpc_testing.FaultyTensorPipeRpcBackendOptions(8, 60.0, "env://", [], {}, -1)
    with pytest.raises(RuntimeError, match="No mapping to rpc::MessageType exists for BOGUS"):
        rpc_testing.FaultyTensorPipeRpcBackendOptions(8, 60.0, "env://", ["BOGUS"], {}, 0)
    with pytest.raises(RuntimeError, match="Delays passed to FaultyTensorPipeAgent must be"):
        rpc_testing.FaultyTensorPipeRpcBackendOptions(8, 60.0, "env://", [], {"PYTHON_CALL": -1})


def test_init_rpc_refuses_plain_options_for_the_faulty_backend() -> None:
    """As torch's init handler: FAULTY_TENSORPIPE needs FaultyTensorPipeRpcBackendOptions."""
    with pytest.raises(TypeError, match="must be a `FaultyTensorPipeRpcBackendOptions`"):
        rpc.init_rpc(
            "worker0",
            backend=rpc.BackendType.FAULTY_TENSORPIPE,
            rank=0,
            world_size=1,
            rpc_backend_options=rpc.TensorPipeRpcBackendOptions(),
        )


# -- each action, on an in-memory world ----------------------------------------------------------
def test_fail_raises_torchs_error_for_sync_and_fails_the_future_for_async() -> None:
    """A failed send raises RPCErr:2 from rpc_sync, and rpc_async returns a failed future, as
    torch's faulty agent does; later calls go through."""
    with open_world(2, faults=[Fault("fail", type="PYTHON_CALL", times=2)]) as world:
        with pytest.raises(
            InjectedFailureError, match="RPCErr:2:Send attempt failed intentionally"
        ):
            world.run_on(0, rpc.rpc_sync, "worker1", add, (1, 2))
        future = world.run_on(0, rpc.rpc_async, "worker1", add, (1, 2))
        with pytest.raises(InjectedFailureError):
            future.wait()
        assert world.run_on(0, rpc.rpc_sync, "worker1", add, (1, 2)) == 3


def test_a_dropped_call_times_out() -> None:
    """A dropped request is never answered: the call fails with torch's timeout error."""
    with open_world(2, faults=[Fault("drop", function="add", nth=1)]) as world:
        with pytest.raises(RpcTimeoutError, match="RPC ran for more than"):
            world.run_on(0, lambda: rpc.rpc_sync("worker1", add, (1, 2), timeout=0.3))
        assert world.faults is not None and len(world.faults.fired("drop")) == 1
        assert world.run_on(0, rpc.rpc_sync, "worker1", add, (1, 2)) == 3


def test_a_dropped_response_times_out_too() -> None:
    """Rules apply to responses (PYTHON_RET) as well: the callee ran, the caller never hears."""
    _seen.clear()
    with open_world(2, faults=[Fault("drop", type="PYTHON_RET", nth=1)]) as world:
        with pytest.raises(RpcTimeoutError):
            world.run_on(0, lambda: rpc.rpc_sync("worker1", record, ("ran",), timeout=0.3))
        assert _seen == ["ran"]


def test_a_delayed_call_arrives_late() -> None:
    """A delayed request is answered after the delay (or times out if that is shorter)."""
    with open_world(2, faults=[Fault("delay", function="add", seconds=0.3)]) as world:
        with pytest.raises(RpcTimeoutError):
            world.run_on(0, lambda: rpc.rpc_sync("worker1", add, (1, 2), timeout=0.1))
        started = time.monotonic()
        assert world.run_on(0, rpc.rpc_sync, "worker1", add, (1, 2)) == 3
        assert time.monotonic() - started >= 0.3


def test_a_duplicated_call_runs_twice_and_answers_once() -> None:
    """The callee runs a duplicated request twice; the caller takes the first answer."""
    _seen.clear()
    with open_world(2, faults=[Fault("duplicate", function="record", nth=1)]) as world:
        assert world.run_on(0, rpc.rpc_sync, "worker1", record, ("x",)) == "x"
        deadline = time.monotonic() + 5
        while len(_seen) < 2 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert _seen == ["x", "x"]


def test_a_reordered_message_goes_after_the_next_one() -> None:
    """A reordered request is held until the next frame on its link went out."""
    _seen.clear()
    with open_world(2, faults=[Fault("reorder", function="record", nth=1)]) as world:

        def two_calls(rank: int) -> list[str]:
            first = rpc.rpc_async("worker1", record, args=("first",))
            second = rpc.rpc_async("worker1", record, args=("second",))
            return [first.wait(), second.wait()]

        assert world.run(two_calls, ranks=[0]) == [["first", "second"]]
        assert _seen == ["second", "first"]


def test_a_severed_link_is_a_dead_peer_on_both_sides() -> None:
    """Severing two workers fails what waits between them and marks each dead to the other."""
    with open_world(3, faults=[]) as world:
        world.run(lambda r: [rpc.rpc_sync(f"worker{d}", add, (r, d)) for d in range(3)])
        assert world.faults is not None
        world.faults.sever(0, 1)
        with pytest.raises(PeerFailureError, match="worker1"):
            world.run_on(0, rpc.rpc_sync, "worker1", add, (1, 2))
        deadline = time.monotonic() + 5
        while not world.agents[1].peer_is_dead(0) and time.monotonic() < deadline:
            time.sleep(0.005)
        assert world.agents[1].peer_is_dead(0)
        assert world.run_on(0, rpc.rpc_sync, "worker2", add, (1, 2)) == 3  # others unaffected
        world.kill(0)


def test_a_frozen_worker_is_suspected_and_called_again_once_thawed() -> None:
    """A frozen worker answers nothing and sends no heartbeats: a call to it fails after the
    peer timeout, not the RPC timeout, and it is suspected, not dead; thawed, it delivers what
    waited and is called again, both ways."""
    options = world_options(heartbeat_interval=0.05, peer_timeout=0.4, rpc_timeout=0)
    with open_world(2, options=options, faults=[]) as world:
        assert world.faults is not None
        assert world.run_on(0, rpc.rpc_sync, "worker1", add, (1, 2)) == 3  # (the link is open)
        world.faults.freeze(1)
        started = time.monotonic()
        with pytest.raises(PeerFailureError, match="suspected"):
            world.run_on(0, rpc.rpc_sync, "worker1", add, (1, 2))
        assert time.monotonic() - started < 5
        assert not world.agents[0].peer_is_dead(1)
        # a new connection to it: its handshake is not answered, within the peer timeout
        started = time.monotonic()
        with pytest.raises(PeerFailureError, match=r"handshake .* timed out"):
            world.run_on(0, rpc.rpc_sync, "worker1", add, (1, 2))
        assert time.monotonic() - started < 2
        assert not world.agents[0].peer_is_dead(1)
        world.faults.thaw(1)
        time.sleep(0.6)  # (after a failed reconnect, calls fail at once for RETRY_AFTER)
        assert world.run_on(0, rpc.rpc_sync, "worker1", add, (1, 2)) == 3
        assert world.run_on(1, rpc.rpc_sync, "worker0", add, (2, 2)) == 4


def test_the_workers_plan_is_reachable_from_its_threads() -> None:
    """current_fault_plan() is the plan of the calling worker's transport."""
    with open_world(2, faults=[]) as world:
        plans = world.run(lambda r: current_fault_plan())
        assert plans[0] is plans[1] is world.faults
    with open_world(1) as world, pytest.raises(RuntimeError, match="injects no faults"):
        world.run(lambda r: current_fault_plan())


def test_retryable_control_messages_survive_torchs_default_failures() -> None:
    """torch's fixture: every retryable message type fails its first 3 sends; RRefs created,
    forked, fetched and deleted still work and leave no fork behind (torch's
    test_check_failed_messages, on three in-memory workers)."""
    plan = FaultPlan(
        messages_to_fail=[
            "RREF_FORK_REQUEST",
            "RREF_CHILD_ACCEPT",
            "RREF_USER_DELETE",
            "CLEANUP_AUTOGRAD_CONTEXT_REQ",
        ],
        num_fail_sends=3,
    )

    def body(rank: int) -> bool:
        if rank != 0:
            return True
        rref = rpc.remote("worker1", torch.add, args=(torch.ones(2, 2), torch.ones(2, 2)))
        other = rpc.remote("worker2", _add_rref_to_value, args=(rref, torch.ones(2, 2)))
        ok = torch.equal(rref.to_here(), torch.full((2, 2), 2.0))
        return ok and torch.equal(other.to_here(), torch.full((2, 2), 3.0))

    with open_world(3, faults=plan) as world:
        assert world.run(body) == [True, True, True]
        agents = world.agents
    assert plan.fired("fail")
    for agent in agents:
        assert context_of(agent).debug_info()["num_forks"] == "0"


def _add_rref_to_value(rref: rpc.RRef[torch.Tensor], value: torch.Tensor) -> torch.Tensor:
    return rref.to_here() + value


def test_a_failed_remote_creation_reads_as_torchs_creation_timeout() -> None:
    """As torch: a PYTHON_REMOTE_CALL that failed to send leaves an RRef whose use raises the
    'RRef creation via rpc.remote() timed out' error."""

    def body(rank: int) -> None:
        if rank == 0:
            rref = rpc.remote("worker1", add, args=(1, 2))
            with pytest.raises(RuntimeError, match="RRef creation"):
                rref.to_here()

    with open_world(2, faults=[Fault("fail", type="PYTHON_REMOTE_CALL")]) as world:
        world.run(body)
