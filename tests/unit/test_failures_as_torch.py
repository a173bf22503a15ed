"""Failures delivered where torch delivers them (issue 23, items 1-4), on in-memory worlds:
a failed ``rpc_async`` future and what torch's future machinery makes of it, ``rpc_async`` to
a dead peer, remote error text, a failed RRef passed on, and ``RRef._serialize`` /
``_deserialize``."""

from __future__ import annotations

import gc
import threading
import time
from typing import Any

import pytest
import torch

import distgrad.rpc as rpc
from distgrad._rpc._rrefs._rref_context import context_of
from distgrad.testing import Fault, World, open_world

EMPTY = {
    "num_owner_rrefs": "0",
    "num_pending_futures": "0",
    "num_pending_users": "0",
    "num_forks": "0",
}


def add(a: Any, b: Any) -> Any:
    return a + b


def fails() -> None:
    raise ValueError("first line\nsecond line")


def sleeps(seconds: float) -> int:
    time.sleep(seconds)
    return 1


def makes(n: int) -> torch.Tensor:
    return torch.arange(float(n))


def fetches(data: tuple[Any, ...]) -> list[float]:
    """Rebuild an RRef shipped by hand and fetch its value."""
    rref = rpc.RRef._deserialize(data)
    return rref.to_here().tolist()  # type: ignore[no-any-return]


def returns_seven(rref: object) -> int:
    return 7


def _wait_empty(world: World, bound: float = 8.0) -> dict[int, dict[str, str]]:
    """Every live worker's RRef tables once empty (bounded); the last state otherwise."""
    deadline = time.monotonic() + bound
    while True:
        gc.collect()
        tables = {r: context_of(world.agents[r]).debug_info() for r in world.alive()}
        if all(t == EMPTY for t in tables.values()) or time.monotonic() > deadline:
            return tables
        time.sleep(0.05)


# -- item 1: a failed future ---------------------------------------------------------------------
def test_a_failed_call_fails_its_future_as_torchs_own_set_exception_does() -> None:
    """A failed rpc_async future behaves as a torch future failed with torch's own
    ``set_exception``: ``wait()``/``value()`` raise the original type (with the remote
    traceback as ``__cause__``), ``done()`` is true, a
    ``then`` callback reading ``value()`` fails the chained future with torch's RuntimeError,
    and ``collect_all(...).wait()`` raises the original type too."""

    def body(rank: int) -> list[object]:
        if rank:
            return []
        ours = rpc.rpc_async("worker1", fails)
        theirs: torch.futures.Future[Any] = torch.futures.Future()
        theirs.set_exception(ValueError("first line\nsecond line"))
        with pytest.raises(ValueError) as remote:
            ours.wait()
        assert isinstance(remote.value.__cause__, rpc.RemoteTraceback)  # the remote traceback
        assert 'raise ValueError("first line' in str(remote.value.__cause__)
        seen: list[object] = []
        for future in (ours, theirs):
            with pytest.raises(ValueError, match="second line"):
                future.wait()
            with pytest.raises(ValueError):
                future.value()
            chained = future.then(lambda f: f.value())
            with pytest.raises(RuntimeError) as caught:
                chained.wait()
            seen.append(str(caught.value).split(":")[0:2])
            with pytest.raises(ValueError):  # the list's futures are unwrapped on the way out
                torch.futures.collect_all([future]).wait()
            seen.append(future.done())
        return seen

    with open_world(2) as world:
        ours_chained, ours_done, theirs_chained, theirs_done = world.run(body)[0]
    assert (
        ours_chained
        == theirs_chained
        == [
            "Got the following error when running the callback",
            " ValueError",
        ]
    )
    assert ours_done is theirs_done is True


def test_wait_all_block_ends_at_the_first_failure() -> None:
    """``with rpc._wait_all():`` raises the first failure of its calls at once, as torch's,
    not after a call still running (here 3 s) finished."""

    def body(rank: int) -> float:
        if rank:
            return 0.0
        start = time.monotonic()
        with pytest.raises(ValueError, match="second line"), rpc._wait_all():
            rpc.rpc_async("worker1", sleeps, (3.0,))
            rpc.rpc_async("worker1", fails)
        return time.monotonic() - start

    with open_world(2) as world:
        elapsed = world.run(body)[0]
    assert elapsed < 1.5, elapsed


def test_wait_all_block_returns_when_every_call_succeeded() -> None:
    """``rpc._wait_all()`` waits for every call of its block when none fails."""

    def body(rank: int) -> list[object]:
        if rank:
            return []
        with rpc._wait_all():
            futures = [rpc.rpc_async("worker1", sleeps, (0.05 * i,)) for i in range(4)]
        return [f.done() for f in futures]

    with open_world(2) as world:
        assert world.run(body)[0] == [True] * 4


# -- item 2: rpc_async to a dead peer ------------------------------------------------------------
def test_rpc_async_to_a_dead_peer_returns_a_failed_future() -> None:
    """As torch's: ``rpc_async`` to a peer known dead returns a future whose ``wait()`` raises
    the peer failure; ``rpc_sync`` and ``remote`` raise it at the call."""

    def body(rank: int) -> list[str]:
        future = rpc.rpc_async("worker1", add, (1, 2))  # no raise here
        with pytest.raises(rpc.PeerFailureError, match="worker1"):
            future.wait()
        future = rpc.rpc_async("worker1", add, (1, 2))  # known dead now: the same
        assert future.done()
        with pytest.raises(rpc.PeerFailureError):
            future.wait()
        with pytest.raises(rpc.PeerFailureError):
            rpc.rpc_sync("worker1", add, (1, 2))
        with pytest.raises(rpc.PeerFailureError):
            rpc.remote("worker1", add, (1, 2))
        return ["ok"]

    with open_world(2) as world:
        world.kill(1)
        assert world.run(body, ranks=[0]) == [["ok"]]


# -- item 3: remote error text -------------------------------------------------------------------
def test_remote_error_message_has_real_line_breaks() -> None:
    """A remote exception's message shows ``repr(e)`` with its ``\\n`` decoded into line
    breaks (torch decodes the message); the remote traceback text is left as it was."""

    def body(rank: int) -> tuple[str, str]:
        try:
            rpc.rpc_sync("worker1", fails)
        except ValueError as exc:
            return str(exc), exc.remote_traceback  # type: ignore[attr-defined]
        raise AssertionError("no error")

    with open_world(2) as world:
        message, remote_tb = world.run(body, ranks=[0])[0]
    assert message.startswith("On WorkerInfo(id=1, name=worker1):\nValueError('first line\n")
    assert "\\n" not in message
    assert "second line')\nTraceback (most recent call last):" in message
    assert 'raise ValueError("first line\\nsecond line")' in remote_tb


# -- item 4: failed RRefs, RRef._serialize / _deserialize -----------------------------------------
@pytest.mark.parametrize("owner", ["worker0", "worker1"])
def test_forking_an_rref_whose_creation_failed_to_send_raises(owner: str) -> None:
    """As torch's (``test_remote_message_dropped_pickle[_to_self]``): when the
    ``PYTHON_REMOTE_CALL`` of ``remote()`` failed -- to this worker too -- ``_serialize()`` and
    passing the RRef in ``rpc_async`` raise "RRef creation" at the call."""

    def body(rank: int) -> None:
        rref = rpc.remote(owner, add, args=(1, 2))
        with pytest.raises(RuntimeError, match="RRef creation"):
            rref._serialize()
        with pytest.raises(RuntimeError, match="RRef creation"):
            rpc.rpc_async("worker1", returns_seven, args=(rref,))

    with open_world(2, faults=[Fault("fail", type="PYTHON_REMOTE_CALL")]) as world:
        world.run(body, ranks=[0])


def test_an_rref_shipped_by_hand_reaches_its_value() -> None:
    """``rref._serialize()`` gives torch's 7-tuple (owner, RRef id, fork id, parent, type);
    ``RRef._deserialize`` of it on another worker (sent as plain data) is a user RRef that
    fetches the value; the owner gets its own RRef back; every table is empty afterwards."""

    def body(rank: int) -> list[object]:
        if rank:
            return []
        rref = rpc.remote("worker1", makes, args=(4,))
        data = rref._serialize()
        fetched = rpc.rpc_sync("worker2", fetches, args=(data,))
        own = rpc.RRef(torch.ones(2))
        own_data = own._serialize()
        back = rpc.RRef._deserialize(own_data)
        same = back.is_owner() and back.local_value() is own.local_value()
        ids = str(rref)
        return [data, fetched, own_data[6], same, ids]

    with open_world(3) as world:
        data, fetched, own_kind, same, ids = world.run(body)[0]
        tables = _wait_empty(world)
    owner, rref_on, rref_local, fork_on, fork_local, parent, kind = data
    assert (owner, parent, kind) == (1, 0, "PyObject")
    assert f"RRefId = GloballyUniqueId(created_on={rref_on}, local_id={rref_local})" in ids
    assert (fork_on, fork_local) != (rref_on, rref_local)
    assert fetched == [0.0, 1.0, 2.0, 3.0]
    assert own_kind == "Tensor"
    assert same
    assert all(t == EMPTY for t in tables.values()), tables


def test_deserialize_refuses_what_is_not_a_fork_tuple() -> None:
    """``RRef._deserialize`` of anything but the 7-tuple raises a ValueError naming it."""

    def body(rank: int) -> None:
        with pytest.raises(ValueError, match="7-tuple"):
            rpc.RRef._deserialize((1, 2, 3))  # type: ignore[arg-type]

    with open_world(1) as world:
        world.run(body)


def test_torch_wait_all_over_failed_futures_waits_for_every_future() -> None:
    """The limit item 1 documents, shown on torch alone: ``torch.futures.wait_all`` does not
    stop at a future failed by torch's own Python ``set_exception`` (only C++ can fail a
    torch future), so it cannot stop at a failed distgrad future either."""
    failed: torch.futures.Future[Any] = torch.futures.Future()
    failed.set_exception(ValueError("failed"))
    pending: torch.futures.Future[Any] = torch.futures.Future()
    timer = threading.Timer(0.3, pending.set_result, (1,))
    timer.start()
    start = time.monotonic()
    with pytest.raises(ValueError):
        torch.futures.wait_all([failed, pending])
    assert time.monotonic() - start >= 0.25
    timer.join()


class Halt(BaseException):
    """Not an ``Exception``: torch's ``Future.set_exception`` refuses it."""


def halts() -> None:
    raise Halt("halted")


def test_a_call_failing_with_a_base_exception_under_the_profiler_fails_its_future() -> None:
    """A profiled ``rpc_async`` whose function raised a ``BaseException`` that is not an
    ``Exception`` fails its future with it (torch's ``set_exception`` would refuse it and
    leave the future pending forever)."""

    def body(rank: int) -> str:
        with torch.autograd.profiler.profile():
            future = rpc.rpc_async("worker1", halts)
            try:
                future.wait()
            except Halt as exc:
                return type(exc).__name__
        return "no error"

    with open_world(2, timeout=10) as world:
        assert world.run(body, ranks=[0]) == ["Halt"]


def test_rref_rpc_async_proxy_to_a_dead_owner_returns_a_failed_future() -> None:
    """``rref.rpc_async().method()`` on an RRef whose owner is known dead returns a failed
    future, as ``rpc_async`` does (it does not raise at the call)."""
    held: list[rpc.RRef[Any]] = []

    def before(rank: int) -> None:
        rref = rpc.remote("worker1", makes, args=(3,))
        rref.to_here()
        held.append(rref)

    def after(rank: int) -> str:
        future = held[0].rpc_async().sum()
        with pytest.raises(rpc.PeerFailureError):
            future.wait()
        return "failed future"

    with open_world(2) as world:
        world.run(before, ranks=[0])
        world.kill(1)
        assert world.run(after, ranks=[0]) == ["failed future"]
        held.clear()


#: the steps of the next test: worker1 serves; its stop began; worker1's function failed
_SERVING, _STOPPING, _FAILED = threading.Event(), threading.Event(), threading.Event()


def calls_on_while_stopping() -> int:
    """Served by worker1: once its stop began, call worker2 (which fails: RPC no longer runs
    here), and raise that error as the request's answer."""
    _SERVING.set()
    try:
        assert _STOPPING.wait(5.0), "the stop never began"
        return rpc.rpc_sync("worker2", add, args=(1, 1))  # type: ignore[no-any-return]
    finally:
        _FAILED.set()


def test_a_worker_stopped_without_grace_answers_nothing() -> None:
    """A request a worker was serving when its stop without grace began gets no answer, as in
    torch ("won't send response ... as the agent is shutting down"): its caller sees the worker
    die (named), never the worker's own "RPC is no longer running on this node". (It went out
    when the served function failed between the stop's start and the connections' close: a
    distributed backward through a killed worker then failed naming only "Node 2".) The stop is
    held at that point here, until the function's error could have been answered."""
    for event in (_SERVING, _STOPPING, _FAILED):
        event.clear()
    with open_world(3, timeout=10) as world:
        transport = world.agents[1].transport
        assert transport is not None
        close = transport.close
        answered: list[Any] = []
        held: list[bool] = []  # whether the close was held until worker1's function failed

        def held_close(graceful: bool) -> None:  # (on the killing thread: records, not asserts)
            _STOPPING.set()  # the stop began (STOPPING): the connections are still open
            held.append(_FAILED.wait(5.0))
            deadline = time.monotonic() + 0.5  # time for an answer to arrive, if one is sent
            while not answered[0].done() and time.monotonic() < deadline:
                time.sleep(0.005)
            close(graceful)

        transport.close = held_close  # type: ignore[method-assign]

        def body(rank: int) -> str:
            future = rpc.rpc_async("worker1", calls_on_while_stopping)
            answered.append(future)
            assert _SERVING.wait(5.0)
            killer = threading.Thread(target=world.kill, args=(1,), daemon=True)
            killer.start()
            with pytest.raises(RuntimeError) as failure:
                future.wait()
            killer.join(5.0)
            return str(failure.value)

        message = world.run(body, ranks=[0])[0]
        assert held == [True], "the stop was not held until worker1's function failed"
        assert "no longer running" not in message, message
        assert "worker1" in message, message
