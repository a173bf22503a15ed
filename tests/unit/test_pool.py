"""Unit tests of the worker pool's tasks that wait for the current one
(``ThreadPool.submit_after_current``, used for context cleanup arriving with a request)."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from distgrad._rpc._core._pool import ThreadPool

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def pool() -> Iterator[ThreadPool]:
    pool = ThreadPool("test-pool", 4)
    try:
        yield pool
    finally:
        pool.stop()


def _thread_count(pool: ThreadPool) -> int:
    return len(pool._threads)


def test_with_no_task_running_it_runs_at_once(pool: ThreadPool) -> None:
    done = threading.Event()
    pool.submit_after_current(done.set)
    assert done.wait(5)


def test_it_runs_after_the_running_task_on_the_same_thread(pool: ThreadPool) -> None:
    release = threading.Event()
    started = threading.Event()
    order: list[tuple[str, int]] = []
    finished = threading.Event()

    def request() -> None:
        started.set()
        assert release.wait(5)
        order.append(("request", threading.get_ident()))

    def cleanup() -> None:
        order.append(("cleanup", threading.get_ident()))
        finished.set()

    pool.submit(request)
    assert started.wait(5)
    pool.submit_after_current(cleanup)
    assert not finished.wait(0.2)  # it waits for the request, on no second thread
    assert _thread_count(pool) == 1
    release.set()
    assert finished.wait(5)
    assert [name for name, _ in order] == ["request", "cleanup"]
    assert order[0][1] == order[1][1]
    # the thread went idle afterwards: the next task needs no new thread
    again = threading.Event()
    pool.submit(again.set)
    assert again.wait(5)
    assert _thread_count(pool) == 1


def _nested_call(
    pool: ThreadPool, go: threading.Event, blocked: threading.Event, release: threading.Event
) -> None:
    """A pool task that, once ``go`` is set, waits in an "RPC" (marked as blocking) until
    ``release``."""
    assert go.wait(5)
    pool.enter_blocking()
    blocked.set()
    try:
        assert release.wait(10)
    finally:
        pool.exit_blocking()


@pytest.mark.parametrize("blocks_first", [True, False])
def test_handed_on_when_the_running_thread_blocks(pool: ThreadPool, blocks_first: bool) -> None:
    """A thread waiting for an RPC may wait long: what waited for its task is queued for
    another thread, whether it blocked before (then at once) or after the submit."""
    go, blocked, release, ran = (threading.Event() for _ in range(4))
    if blocks_first:
        go.set()
    pool.submit(_nested_call, pool, go, blocked, release)
    if blocks_first:
        assert blocked.wait(5)
    pool.submit_after_current(ran.set)
    if not blocks_first:
        assert not ran.wait(0.2)  # waits for the running task...
        go.set()  # ...which now blocks in an RPC
    assert ran.wait(5)
    assert not release.is_set()  # the blocked task is still waiting
    release.set()


def test_a_failing_task_is_logged_and_the_thread_goes_on(
    pool: ThreadPool, caplog: pytest.LogCaptureFixture
) -> None:
    release = threading.Event()
    started = threading.Event()
    ran = threading.Event()

    def request() -> None:
        started.set()
        assert release.wait(5)

    def broken() -> None:
        raise ValueError("cleanup failed")

    pool.submit(request)
    assert started.wait(5)
    pool.submit_after_current(broken)
    pool.submit_after_current(ran.set)
    release.set()
    assert ran.wait(5)
    assert "cleanup failed" in caplog.text


def test_refused_once_stopped(pool: ThreadPool) -> None:
    pool.stop()
    with pytest.raises(RuntimeError, match="stopped"):
        pool.submit_after_current(lambda: None)
