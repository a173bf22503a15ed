"""The public API's docstrings have torch's level of detail: every public callable says what
it takes, returns and raises, and the main entry points show a two-worker example."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import distgrad.autograd as dist_autograd
import distgrad.nn
import distgrad.optim
import distgrad.rpc as rpc

MODULES = (rpc, rpc.functions, dist_autograd, distgrad.optim, distgrad.nn)

# The calls a program is made of: each documents its arguments, what it raises, and shows
# code for both workers of a group, as torch's rpc/api.py does.
ENTRY_POINTS: list[Callable[..., Any]] = [
    rpc.init_rpc,
    rpc.shutdown,
    rpc.rpc_sync,
    rpc.rpc_async,
    rpc.remote,
    dist_autograd.backward,
    distgrad.optim.DistributedOptimizer,
    distgrad.nn.RemoteModule,
]


def _public_callables() -> Iterator[tuple[str, Any]]:
    for module in MODULES:
        for name in module.__all__:
            obj = getattr(module, name)
            if inspect.ismodule(obj) or not callable(obj):
                continue
            yield f"{module.__name__}.{name}", obj
            if inspect.isclass(obj) and not issubclass(obj, BaseException):
                for attr, value in vars(obj).items():
                    if not attr.startswith("_") and inspect.isfunction(value):
                        yield f"{module.__name__}.{name}.{attr}", value


def _takes_arguments(obj: Any) -> bool:
    try:
        params = inspect.signature(obj).parameters
    except (TypeError, ValueError):
        return False
    return any(p not in ("self", "cls") for p in params)


@pytest.mark.parametrize(
    ("name", "obj"), [pytest.param(name, obj, id=name) for name, obj in _public_callables()]
)
def test_public_callable_is_documented(name: str, obj: Any) -> None:
    """A public callable has a docstring of its own; one that takes arguments documents them
    (``Args:``), unless it is one of RemoteModule's unsupported nn.Module methods."""
    doc = inspect.getdoc(obj)
    assert doc, f"{name} has no docstring"
    if doc.startswith("Not supported for RemoteModule (raises ``ValueError``)"):
        return
    if inspect.isfunction(obj) and _takes_arguments(obj):
        assert "Args:" in doc, f"{name} does not document its arguments"


@pytest.mark.parametrize("obj", ENTRY_POINTS, ids=lambda f: f.__qualname__)
def test_entry_points_have_torchs_level_of_detail(obj: Any) -> None:
    """The main entry points document arguments, errors and a two-worker example."""
    doc = inspect.getdoc(obj)
    assert doc is not None
    for section in ("Args:", "Raises:", "Example:"):
        assert section in doc, f"{obj.__qualname__}: no {section}"
    example = doc.split("Example:", 1)[1]
    assert "worker1" in example and ("worker 0" in example or "worker0" in example)
