"""Shared test setup: import paths, the guarantee that no test leaves a process behind, and
the ``needs`` marker (a missing need skips a test, or fails it in CI: tests/_needs.py)."""

from __future__ import annotations

import multiprocessing
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

_REPO = Path(__file__).resolve().parent.parent
for _path in (str(_REPO / "src"), str(_REPO)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from tests._harness import child_pids  # noqa: E402
from tests._needs import MARKER, in_ci, missing_need  # noqa: E402


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{MARKER}(missing): the test cannot run where `missing` (a reason) is not None: "
        "skipped there, failed in CI (tests/_needs.py)",
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Outside CI, a test that lacks something it needs (its ``needs`` marks) is skipped."""
    if in_ci():
        return
    for item in items:
        missing = missing_need(item)
        if missing is not None:
            item.add_marker(pytest.mark.skip(reason=missing))


def pytest_runtest_setup(item: pytest.Item) -> None:
    """In CI, a test that lacks something it needs fails instead."""
    missing = missing_need(item)
    if missing is not None and in_ci():
        pytest.fail(f"CI=true, and this test cannot run here: {missing}", pytrace=False)


def _leftovers() -> list[str]:
    found = [f"{p.name} (pid {p.pid})" for p in multiprocessing.active_children()]
    found += [f"pid {pid}: {cmdline}" for pid, cmdline in child_pids()]
    return found


@pytest.fixture(autouse=True)
def no_process_left_behind() -> Iterator[None]:
    """Each test ends with no child process of the test process still alive (or unreaped)."""
    yield
    leftovers = _leftovers()
    assert not leftovers, f"the test left child processes behind: {leftovers}"


@pytest.fixture(scope="session", autouse=True)
def no_process_left_at_the_end() -> Iterator[None]:
    """The whole session ends with no child process left."""
    yield
    leftovers = _leftovers()
    assert not leftovers, f"the session left child processes behind: {leftovers}"
