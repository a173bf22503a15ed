"""The worker-process harness itself: failures carry tracebacks, runs are bounded, processes
that die or stop are handled, and per-rank settings reach the right child."""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests._harness import Died, WorkerFailure, child_pids, run_workers

pytestmark = pytest.mark.timeout(60)


def report_settings(rank: int, world_size: int, port: int, color: str, shared: int) -> object:
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    if rank == 2:
        os.kill(os.getpid(), signal.SIGSTOP)
    return (rank, world_size, color, shared, os.environ.get("DISTGRAD_SECRET"), os.environ["ONLY"])


def test_per_rank_kwargs_env_secret_and_ranks_that_may_die() -> None:
    """Per-rank kwargs and env reach their child, a given secret is set; a rank that kills
    itself or stops itself is tolerated (and reaped) when it may die."""
    started = time.monotonic()
    results = run_workers(
        report_settings,
        3,
        init=False,
        kwargs={"color": "red", "shared": 7},
        rank_kwargs={0: {"color": "blue"}},
        rank_env={0: {"ONLY": "zero"}},
        env={"ONLY": "all"},
        may_die={1, 2},
        secret="given",
        timeout=30,
    )
    assert time.monotonic() - started < 20  # the stopped rank was not waited for
    rank, world_size, color, shared, secret, only = results[0]
    assert (rank, world_size, color, shared, only) == (0, 3, "blue", 7, "zero")
    assert secret == "given"
    assert results[1] == Died(-signal.SIGKILL)
    assert results[2] == Died(-signal.SIGKILL)  # stopped, then killed by the harness


def secret_of(rank: int, world_size: int, port: int) -> object:
    return os.environ.get("DISTGRAD_SECRET")


def test_each_run_gets_a_fresh_secret() -> None:
    """Without a given secret, each run makes a random one, shared by its ranks."""
    first = run_workers(secret_of, 2, init=False)
    second = run_workers(secret_of, 1, init=False)
    assert first[0] == first[1] and len(first[0]) == 32
    assert second[0] and second[0] != first[0]


def fail_on_rank_1(rank: int, world_size: int, port: int) -> str:
    if rank == 1:
        raise ValueError("distinctive failure text")
    return "fine"


def test_a_failing_worker_fails_the_run_with_its_traceback() -> None:
    """A worker's exception fails the run, showing the worker's traceback."""
    with pytest.raises(WorkerFailure) as info:
        run_workers(fail_on_rank_1, 2, init=False, timeout=30)
    text = str(info.value)
    assert "worker1" in text and "distinctive failure text" in text
    assert "Traceback" in text and "fail_on_rank_1" in text
    assert "worker0" not in text.split("----", 2)[1]  # only the failing rank is reported


def hang(rank: int, world_size: int, port: int) -> None:
    time.sleep(600)


def test_a_hanging_run_is_killed_at_the_timeout() -> None:
    """A run that does not finish fails at its timeout, and its processes are gone."""
    started = time.monotonic()
    with pytest.raises(WorkerFailure, match="did not finish within the harness timeout of 3s"):
        run_workers(hang, 2, init=False, timeout=3)
    assert time.monotonic() - started < 15
    assert child_pids() == []


def die_unexpectedly(rank: int, world_size: int, port: int) -> None:
    os._exit(3)


def test_a_worker_that_dies_without_a_result_fails_the_run() -> None:
    """A rank that exits without reporting (and may not die) fails the run with its exit code."""
    with pytest.raises(WorkerFailure, match=r"exited without a result \(exit code 3\)"):
        run_workers(die_unexpectedly, 1, init=False, timeout=30)


def unpicklable_result(rank: int, world_size: int, port: int) -> object:
    return lambda: None


def test_an_unpicklable_result_is_reported() -> None:
    """A result that cannot be sent back fails the run with a clear message."""
    with pytest.raises(WorkerFailure, match="result is not picklable"):
        run_workers(unpicklable_result, 1, init=False, timeout=30)
