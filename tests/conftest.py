"""Shared test setup: import paths, and the guarantee that no test leaves a process behind."""

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
