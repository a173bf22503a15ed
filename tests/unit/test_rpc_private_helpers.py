"""torch's profiling switches and private RPC helpers that programs reach (issue 23, item 9),
on in-memory worlds: ``rpc.enable_gil_profiling``, ``rpc._server_process_global_profile``
used through an RRef, ``rpc.TensorPipeAgent``, ``rpc.internal.serialize``."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import distgrad.rpc as rpc
from distgrad.testing import Fault, open_world


def add(a: Any, b: Any) -> Any:
    return a + b


def debug_info() -> dict[str, str]:
    return rpc.api._get_current_rpc_agent().get_debug_info()


def test_current_agent_is_a_tensorpipe_agent() -> None:
    """``isinstance(rpc.api._get_current_rpc_agent(), rpc.TensorPipeAgent)`` holds, as the
    programs that check it expect."""
    with open_world(1) as world:
        assert world.run(
            lambda r: isinstance(rpc.api._get_current_rpc_agent(), rpc.TensorPipeAgent)
        ) == [True]


def test_gil_profiling_adds_the_average_wait_to_debug_info() -> None:
    """``rpc.enable_gil_profiling(True)`` adds ``agent.gil_average_wait_time_us`` (a string
    of a float, as torch's ``std::to_string``) to the agent's debug info and metrics; off by
    default; ``False`` removes it again."""

    def body(rank: int) -> list[object]:
        if rank == 0:
            return []
        before = sorted(debug_info())
        rpc.enable_gil_profiling(True)
        return [before]

    key = "agent.gil_average_wait_time_us"
    with open_world(2) as world:
        (before,) = world.run(body, ranks=[1])[0]
        world.run(lambda r: [rpc.rpc_sync("worker1", add, (i, 1)) for i in range(20)], ranks=[0])
        info = world.run_on(1, debug_info)
        metrics = world.run_on(1, lambda: rpc.api._get_current_rpc_agent().get_metrics())
        world.run_on(1, rpc.enable_gil_profiling, False)
        after = world.run_on(1, debug_info)
    assert key not in before
    value = info[key]
    assert float(value) >= 0.0 and len(value.split(".")[1]) == 6, value
    assert float(value) > 0.0  # 20 requests waited for a thread a little
    assert metrics[key]
    assert key not in after


def test_enable_gil_profiling_needs_rpc() -> None:
    """Before ``init_rpc``, ``enable_gil_profiling`` raises torch's not-initialized error."""
    with pytest.raises(RuntimeError, match="RPC has not been initialized"):
        rpc.enable_gil_profiling(True)


def test_server_process_global_profile_through_an_rref() -> None:
    """torch's documented use: a client opens ``_server_process_global_profile`` on a server
    through an RRef; the profiler records what the server serves while it is open, nested
    profilers see their own ranges, and ``key_averages()`` comes back to the client."""

    def body(rank: int) -> tuple[set[str], set[str], list[str]]:
        x, y = torch.tensor(1), torch.tensor(2)
        outer = rpc.remote("worker1", rpc._server_process_global_profile)
        outer.rpc_sync().__enter__()
        rpc.rpc_sync("worker1", torch.add, (x, y))
        inner = rpc.remote("worker1", rpc._server_process_global_profile)
        inner.rpc_sync().__enter__()
        rpc.rpc_sync("worker1", torch.sub, (x, y))
        inner.rpc_sync().__exit__(None, None, None)
        outer.rpc_sync().__exit__(None, None, None)
        rpc.rpc_sync("worker1", torch.mul, (x, y))  # after both closed: in neither
        names = [e.key for e in inner.rpc_sync().key_averages()]
        outer_names = {e.name for e in outer.to_here().function_events}
        inner_names = {e.name for e in inner.to_here().function_events}
        return outer_names, inner_names, names

    with open_world(2) as world:
        outer_names, inner_names, averaged = world.run(body, ranks=[0])[0]
    assert {"aten::add", "aten::sub"} <= outer_names
    assert "aten::sub" in inner_names and "aten::add" not in inner_names
    assert "aten::mul" not in outer_names
    assert "aten::sub" in averaged


def test_server_process_global_profile_is_not_reentrant() -> None:
    """Entering one twice raises torch's "not reentrant" error; a disabled one does nothing
    (its ``__enter__`` returns None, as torch's)."""
    profile = rpc._server_process_global_profile()
    with profile, pytest.raises(RuntimeError, match="not reentrant"):
        profile.__enter__()
    with rpc._server_process_global_profile(enabled=False) as off:
        assert off is None


def test_internal_serialize_round_trip() -> None:
    """``rpc.internal.serialize`` puts tensors in a table beside the stream; ``deserialize``
    rebuilds the object; an RRef in it is forked (``RRef._deserialize`` semantics)."""

    def body(rank: int) -> list[object]:
        t = torch.arange(3.0)
        rref = rpc.RRef(torch.ones(1))
        data, table = rpc.internal.serialize({"t": t, "n": 5, "r": rref})
        back = rpc.internal.deserialize(data, table)
        return [
            isinstance(data, bytes),
            len(table),
            back["t"].tolist(),
            back["n"],
            back["r"].local_value() is rref.local_value(),
            rpc.internal._build_rpc_profiling_key(
                rpc.internal.RPCExecMode.SYNC, "f", "worker0", "worker1"
            ),
        ]

    with open_world(1) as world:
        assert world.run(body)[0] == [
            True,
            1,
            [0.0, 1.0, 2.0],
            5,
            True,
            "rpc_sync#f(worker0 -> worker1)",
        ]


def test_broadcast_to_followers_is_what_the_leader_of_all_gather_sends() -> None:
    """``rpc.api._broadcast_to_followers`` is the function the leader of ``_all_gather``
    calls on each follower: one message naming it goes from worker0 (the leader) to each of
    worker1 and worker2, and every worker gets the gathered dict."""
    function = rpc.api._broadcast_to_followers
    name = f"{function.__module__}.{function.__qualname__}"
    seen = Fault("delay", function=name, seconds=0.0)  # (only watches)
    with open_world(3, faults=[seen]) as world:
        gathered = world.run(lambda r: rpc.api._all_gather(r * 10))
        assert world.faults is not None
        calls = world.faults.fired(type="PYTHON_CALL")
    sent = sorted((a.src, a.dst, a.function) for a in calls)
    everyone = {"worker0": 0, "worker1": 10, "worker2": 20}
    assert gathered == [everyone] * 3
    assert sent == [(0, 1, name), (0, 2, name)]


def test_the_leader_of_all_gather_returns_when_a_follower_leaves_before_its_answer() -> None:
    """A follower's handler lets it go before its answer to the broadcast is written, so a
    follower that leaves at once (``shutdown(graceful=False)`` right after a barrier) can close
    its connection first: the answer is lost, and the leader still returns the gathered dict
    (before: the leader's barrier raised the follower's connection loss)."""
    function = rpc.api._broadcast_to_followers
    name = f"{function.__module__}.{function.__qualname__}"
    lost = Fault("break", function=name, src=1)  # worker1's link breaks as it answers
    with open_world(2, faults=[lost]) as world:
        gathered = world.run(lambda r: rpc.api._all_gather(r * 10))
        assert world.faults is not None
        # (worker1 is still there: the leader sends the result again, a few times at most,
        # since it cannot tell whether it arrived; worker1 has it already and ignores it)
        assert 1 <= len(world.faults.fired("break")) <= 6
        world.kill(1)
    assert gathered == [{"worker0": 0, "worker1": 10}] * 2
