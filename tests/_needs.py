"""What a test needs from the machine -- root, network namespaces, a command, a kernel call --
and what happens where it is missing: a skip on a developer's machine, a failure in CI.

``needs(missing)`` marks a test (or a module, through ``pytestmark``, or a parameter, through
``pytest.param(..., marks=...)``); ``missing`` is the reason it cannot run here, or None where it
can (:func:`command` and :func:`tests._netns.unavailable` give one). tests/conftest.py turns the
mark into a skip -- or, where ``CI`` is set to a true value (``.ci/run`` sets ``CI=true``), into
a failure at set-up: a CI machine that lost ``openssl`` or network namespaces must not turn
into quiet skips.

GPU tests are not marked so: CI has no GPU, and they skip there (``skipif`` on
``torch.cuda.is_available()``)."""

from __future__ import annotations

import os
import shutil

import pytest

__all__ = ["MARKER", "command", "in_ci", "missing_need", "needs"]

MARKER = "needs"


def in_ci() -> bool:
    """Whether this run is CI's (``CI`` set to true, as CI services and ``.ci/run`` set it)."""
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def command(name: str, path: str | None = None) -> str | None:
    """Why the command ``name`` cannot run here (None where it can be found on ``path``)."""
    return None if shutil.which(name, path=path) else f"needs the {name} command"


def needs(missing: str | None) -> pytest.MarkDecorator:
    """Mark a test that cannot run where ``missing`` (a reason) is not None."""
    return getattr(pytest.mark, MARKER)(missing)


def missing_need(item: pytest.Item) -> str | None:
    """What the test ``item`` needs and lacks here, from its ``needs`` marks (None: nothing)."""
    for mark in item.iter_markers(MARKER):
        if mark.args[0] is not None:
            return str(mark.args[0])
    return None
