"""Unit tests of the lean path of a plain call (issue 28): which calls take it on each side,
and that what it leaves out changes nothing that can be observed -- the statistics, remote
errors, the size limits, the allow-list, recording inside a distributed autograd context."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import distgrad.autograd as dist_autograd
import distgrad.rpc as rpc
from distgrad._errors import MessageTooLargeError
from distgrad._rpc._core import _layer
from distgrad._rpc._core._codec import Codec
from distgrad._rpc._core._outgoing import Outgoing
from distgrad._rpc._core._worker_info import WorkerInfo
from distgrad._testing._world import open_world, world_options
from distgrad._transport._base import PeerAddress


def add(a: Any, b: Any) -> Any:
    return a + b


def fail() -> None:
    raise ValueError("no")


def in_context(dst: str) -> int:
    """Calls ``add`` inside a distributed autograd context; the contexts the callee knows."""
    with dist_autograd.context():
        rpc.rpc_sync(dst, add, (1, 2))
    return 0


class Paths:
    """Counts the requests each side's lean path took: the caller's plain sends, the
    callee's requests whose references were collected (the general path's)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.plain = 0
        self.collected = 0
        send_plain = Outgoing._send_plain

        def counting_send(outgoing: Outgoing, *args: Any) -> Any:
            self.plain += 1
            return send_plain(outgoing, *args)

        monkeypatch.setattr(Outgoing, "_send_plain", counting_send)
        references = _layer._references
        assert references is not None  # (RRefs are plugged in by distgrad.rpc)
        start = references.start_collecting

        def counting_start() -> object:
            self.collected += 1
            return start()

        monkeypatch.setattr(references, "start_collecting", counting_start)


@pytest.fixture
def paths(monkeypatch: pytest.MonkeyPatch) -> Iterator[Paths]:
    yield Paths(monkeypatch)


RUNS = {"total": 0}


def total(*xs: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    RUNS["total"] += 1
    return sum(xs, torch.zeros(())) * scale


def test_plain_calls_take_the_lean_path_on_both_sides(paths: Paths) -> None:
    """``rpc_sync`` and ``rpc_async`` of a function with plain arguments, or with CPU tensors
    among them, are sent and served on the lean path (no references collected on the
    callee) with the right results; a tensor subclass (a ``Parameter``), or a call inside an
    autograd context, takes the general path."""
    with open_world(2) as world:
        assert world.run_on(0, rpc.rpc_sync, "worker1", add, (1, 2)) == 3
        assert world.run_on(0, lambda: rpc.rpc_async("worker1", add, ("a", "b")).wait()) == "ab"
        assert (paths.plain, paths.collected) == (2, 0)
        got = world.run_on(0, rpc.rpc_sync, "worker1", add, (torch.ones(2), 1))
        assert torch.equal(got, torch.full((2,), 2.0))
        x, y = torch.arange(6.0).reshape(2, 3), torch.ones(2, 3, dtype=torch.float64)
        runs = RUNS["total"]
        got = world.run_on(0, rpc.rpc_sync, "worker1", total, (x, y, x[1:]), {"scale": 2.0})
        assert torch.equal(got, (x + y + x[1:]) * 2.0)
        assert RUNS["total"] == runs + 1  # run once, as by torch's callee
        got = world.run_on(
            0, lambda: rpc.rpc_async("worker1", add, kwargs={"a": x, "b": x.t().t()}).wait()
        )
        assert torch.equal(got, x + x)
        assert (paths.plain, paths.collected) == (5, 0)
        weight = torch.nn.Parameter(torch.ones(2))
        got = world.run_on(0, rpc.rpc_sync, "worker1", add, (weight, 1))
        assert torch.equal(got, torch.full((2,), 2.0)) and got.requires_grad
        assert (paths.plain, paths.collected) == (5, 1)
        world.run_on(0, in_context, "worker1")
        assert paths.plain == 5  # recorded: the general path, which wraps it
        assert world.agents[1].agent_statistics().layers["autograd_contexts"] >= 1


def test_lean_calls_are_counted_exactly(paths: Paths) -> None:
    """The statistics of lean calls -- sent, failed, bytes each way, per function and
    outcome, in flight -- are what the general path counts."""
    with open_world(2) as world:
        world.run_on(0, rpc.rpc_sync, "worker1", add, (1, 2))
        with pytest.raises(ValueError, match="no"):
            world.run_on(0, rpc.rpc_sync, "worker1", fail)
        world.run_on(0, rpc.rpc_sync, "worker1", add, (torch.ones(1000), 1))
        assert paths.plain == 3
        caller = world.agents[0].agent_statistics()
        callee = world.agents[1].agent_statistics()
    to_callee = caller.peers["worker1"]
    assert (to_callee.calls_sent, to_callee.calls_failed, to_callee.calls_in_flight) == (3, 1, 0)
    functions = to_callee.functions
    assert functions[f"{__name__}.add"].outcomes["ok"] == 2
    assert functions[f"{__name__}.fail"].outcomes["remote"] == 1
    from_caller = callee.peers["worker0"]
    assert (from_caller.requests_served, from_caller.requests_failed) == (3, 1)
    assert from_caller.requests_in_flight == 0
    assert from_caller.bytes_received == to_callee.bytes_sent > 4000  # (the tensor's bytes)
    assert from_caller.bytes_sent == to_callee.bytes_received > 4000


def gone() -> None:
    """Removed from this module once its call is pickled (see below)."""


def test_a_plain_request_for_a_missing_function_fails_as_on_the_general_path(
    paths: Paths, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A plain request whose function the callee cannot find is answered with torch's error
    about functions defined on both sides, as on the general path."""
    post = Outgoing._post

    def post_then_forget(outgoing: Outgoing, *args: Any) -> None:
        if hasattr(sys.modules[__name__], "gone"):  # (the callee will not find it)
            monkeypatch.delattr(sys.modules[__name__], "gone")
        post(outgoing, *args)

    monkeypatch.setattr(Outgoing, "_post", post_then_forget)
    with open_world(2) as world:
        with pytest.raises(RuntimeError, match="does not serialize"):
            world.run_on(0, rpc.rpc_sync, "worker1", gone)
        assert (paths.plain, paths.collected) == (1, 0)  # (both sides' lean paths)


def fail_with(_tensor: torch.Tensor) -> None:
    raise ValueError("ran")


def test_the_allow_list_still_refuses_plain_requests() -> None:
    """With an allow-list, a plain request, or one of CPU tensors, goes through the guarded
    general path and a function off the list is refused."""
    options = world_options()
    options.allowed_calls = [f"{__name__}.add"]
    with open_world(2, options=options) as world:
        assert world.run_on(0, rpc.rpc_sync, "worker1", add, (1, 2)) == 3
        got = world.run_on(0, rpc.rpc_sync, "worker1", add, (torch.ones(2), 1))
        assert torch.equal(got, torch.full((2,), 2.0))
        with pytest.raises(Exception, match="allow-list"):
            world.run_on(0, rpc.rpc_sync, "worker1", fail)
        with pytest.raises(Exception, match="allow-list"):
            world.run_on(0, rpc.rpc_sync, "worker1", fail_with, (torch.ones(2),))
        assert world.agents[1].agent_statistics().peers["worker0"].requests_refused == 2


def test_the_codec_asks_about_a_size_only_above_the_lowest_limit() -> None:
    """``least_limit`` is the lowest of this worker's limit and its peers' (which come with
    their addresses); ``check_bytes`` refuses what the receiver would, naming it."""
    options = world_options()
    options.max_message_size = 1000
    codec = Codec(options, {1: WorkerInfo("w1", 1)}, lambda rank: f"worker w{rank}")
    assert codec.least_limit == 1000
    codec.set_peer_limits({1: PeerAddress("h", 0, None, "h", max_message_size=100)})
    assert codec.least_limit == 100
    codec.check_bytes(100, 1)
    with pytest.raises(MessageTooLargeError, match="maximum message size of worker w1 of 100"):
        codec.check_bytes(101, 1)
    codec.check_bytes(1000, 2)  # another peer: this worker's limit
    with pytest.raises(MessageTooLargeError, match="maximum message size of 1000"):
        codec.check_bytes(1001, 2)
    codec.set_peer_limit(1, 5000)  # (above this worker's: not kept)
    assert codec.least_limit == 1000


def test_the_lean_shape_allows_cpu_tensors_where_plain_allows_atoms() -> None:
    """``is_lean``: a request of atoms, functions and CPU tensors, at most two levels deep
    (arguments and keyword values) -- nothing that could be a reference or land on a
    device."""
    from distgrad._wire._pickler import is_lean

    t = torch.ones(3)
    assert is_lean((add, (t, 1, "x"), {"b": t, "c": None}))
    assert is_lean((add, (t[1:], t.t()), {}))
    assert not is_lean((add, ((t,),), {}))  # deeper than arguments
    assert not is_lean((add, ([t],), {}))
    assert not is_lean((add, (torch.nn.Parameter(t),), {}))  # a subclass: the general path
    assert not is_lean((add, (torch.empty(2, device="meta"),), {}))  # not on the CPU
    assert not is_lean((add, (t,), {1: t}))
    assert not is_lean((add, tuple([t] * 9), {}))
    assert not is_lean(t)


def test_a_callee_without_the_lean_path_serves_a_lean_request_the_same(
    monkeypatch: pytest.MonkeyPatch, paths: Paths
) -> None:
    """A peer that does not know ``LEAN`` (its bit ignored: the general path) serves such a
    request with the same result -- what lets the flag go to older peers without a protocol
    version of its own."""
    from distgrad._rpc._core import _serving
    from distgrad._wire._pickler import LEAN, PLAIN

    flags: list[int] = []
    post = Outgoing._post

    def recording_post(outgoing: Outgoing, call: Any, dst: Any, size: int, *rest: Any) -> None:
        flags.append(rest[2])  # (meta, buffers, flags, info)
        post(outgoing, call, dst, size, *rest)

    monkeypatch.setattr(Outgoing, "_post", recording_post)
    monkeypatch.setattr(_serving, "_LEAN_FLAGS", PLAIN)  # the callee no longer knows LEAN
    with open_world(2) as world:
        x = torch.arange(4.0)
        got = world.run_on(0, rpc.rpc_sync, "worker1", total, (x, x), {"scale": 3.0})
        assert torch.equal(got, (x + x) * 3.0)
        assert flags == [LEAN]  # sent flagged, and served on the general path:
        assert (paths.plain, paths.collected) == (1, 1)  # its references were collected
