"""Unit tests of the agent's calls table (``distgrad._rpc._core._call_table``) on the in-memory
transport: calls inserted by many threads while a peer failure fails them all end failed."""

from __future__ import annotations

import sys
import threading
import time

import torch

import distgrad.rpc as rpc
from distgrad._errors import PeerFailureError
from distgrad._rpc._core._call_table import CallTable
from distgrad._rpc._core._calls import _Call
from distgrad._testing._world import open_world, world_options

_release = threading.Event()


def hold() -> int:
    """Answers only once released (so calls stay in the caller's table)."""
    _release.wait(30)
    return 1


class _FakeLink:
    """Only what the table looks at: identity (``take_on``) -- no transport needed."""


def test_take_on_takes_exactly_the_calls_on_that_link() -> None:
    """A broken link's calls are taken out (and out of the timeout wheel); others stay."""
    table = CallTable()
    broken, healthy = _FakeLink(), _FakeLink()
    calls = []
    for link in (broken, healthy, broken):
        call = _Call(table.next_id(), link, 1.0, torch.futures.Future(), internal=False)  # type: ignore[arg-type]
        table.add(call)
        table.sent(call)
        calls.append(call)
    assert table.arm(calls[0], time.monotonic() + 1.0)  # the wheel was idle: start it
    assert not table.arm(calls[2], time.monotonic() + 1.0)  # it runs already
    taken = table.take_on(broken)  # type: ignore[arg-type]
    assert sorted(c.cid for c in taken) == [calls[0].cid, calls[2].cid]
    assert list(table) == [calls[1].cid] and all(c.slot == 0 for c in taken)
    assert table.expire(time.monotonic() + 5.0) == ([], False)  # nothing left to time out


def test_take_on_leaves_a_call_being_written_to_its_sender() -> None:
    """A call whose request is still being written stays in the table when its link breaks
    (only its sender knows whether the frame left); once sent, the link's loss takes it."""
    table = CallTable()
    link = _FakeLink()
    call = _Call(table.next_id(), link, 1.0, torch.futures.Future(), internal=False)  # type: ignore[arg-type]
    table.add(call)
    assert table.take_on(link) == []  # type: ignore[arg-type]
    assert list(table) == [call.cid]
    table.sent(call)
    assert table.take_on(link) == [call]  # type: ignore[arg-type]
    assert len(table) == 0


def test_calls_inserted_while_a_peer_fails_all_end_failed() -> None:
    """Eight threads keep starting calls to a worker while its link's failure is reported
    (repeatedly, then for real: severed): every call ends failed with a PeerFailureError (none
    is left waiting, as when the failure skipped calls inserted meanwhile), the table empty."""
    _release.clear()
    options = world_options(rpc_timeout=0)  # a call left behind would wait forever
    try:
        with open_world(2, options=options) as world:
            agent = world.agents[0]
            futures: list[torch.futures.Future[int]] = []
            refused: list[BaseException] = []
            started = threading.Barrier(9)
            lock = threading.Lock()

            def caller(rank: int) -> None:
                started.wait(10)
                for _ in range(1000):
                    try:
                        future = rpc.rpc_async("worker1", hold)
                    except PeerFailureError as exc:  # the peer is known dead: refused at once
                        with lock:
                            refused.append(exc)
                        return
                    with lock:
                        futures.append(future)

            threads = [threading.Thread(target=world.run_on, args=(0, caller, 0)) for _ in range(8)]
            for thread in threads:
                thread.start()
            started.wait(10)
            while len(futures) < 2000:  # some calls wait, others are being inserted
                time.sleep(0.001)
            switch = sys.getswitchinterval()
            sys.setswitchinterval(1e-6)  # threads interleave within the failure's loop
            try:
                # the link's failure reported (as the I/O thread does) while calls go in
                link = agent.transport.connection(1)
                for _ in range(100):
                    error = PeerFailureError("the link to worker1 broke", "worker1")
                    agent.on_connection_lost(link, error, peer_dead=False)
                agent.transport.sever(1)  # type: ignore[attr-defined]
                for thread in threads:
                    thread.join(20)
            finally:
                sys.setswitchinterval(switch)
            for thread in threads:
                thread.join(20)
            assert not any(thread.is_alive() for thread in threads)
            deadline = time.monotonic() + 10.0
            while not all(f.done() for f in futures) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert all(f.done() for f in futures), "a call was left waiting"
            errors = []
            for future in futures:
                try:
                    future.wait()
                except PeerFailureError as exc:
                    errors.append(exc)
            assert len(errors) == len(futures)
            assert len(agent._calls) == 0 and agent.active_calls() == 0
            _release.set()
            world.kill(1)
    finally:
        _release.set()


def test_a_call_added_with_a_deadline_is_in_the_wheel_at_once() -> None:
    """``add(call, deadline)`` registers and arms in one step (an ``rpc_async`` call's
    timeout): the first starts the idle wheel, the call expires after its deadline, and one
    taken out before is out of the wheel too."""
    table = CallTable()
    link = _FakeLink()
    now = time.monotonic()
    first = _Call(table.next_id(), link, 1.0, torch.futures.Future(), internal=False)  # type: ignore[arg-type]
    second = _Call(table.next_id(), link, 1.0, torch.futures.Future(), internal=False)  # type: ignore[arg-type]
    assert table.add(first, now + 1.0)  # the wheel was idle: start it
    assert not table.add(second, now + 1.0)  # it runs already
    assert first.slot and second.slot
    assert table.pop(second.cid) is second and second.slot == 0
    assert table.expire(now + 0.5) == ([], True)  # not yet
    assert table.expire(now + 5.0) == ([first], False)  # expired; nothing left to tick for
    assert len(table) == 0
