"""Unit tests of TorchScript functions in messages (``distgrad._rpc._core._torchscript``): they
travel by qualified name and come back as the same function."""

from __future__ import annotations

import re
import time

import pytest
import torch
from torch.distributed.rpc import RRef as TorchRRef  # (the RRef type TorchScript knows)

import distgrad.rpc as rpc
from distgrad._rpc._core._torchscript import AsyncScriptFunction, as_rpc_target, script_function
from distgrad._wire._pickler import dumps, loads
from distgrad.nn import RemoteModule
from distgrad.testing import open_world


@torch.jit.script
def script_double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@rpc.functions.async_execution
@torch.jit.script
def script_later(x: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    return torch.jit.fork(script_double, x)


def test_script_function_travels_by_name() -> None:
    """A ScriptFunction in a message is its qualified name, read back as the same function."""
    meta, buffers, flags = dumps((script_double, (torch.ones(1),), {}))
    assert script_double.qualified_name.encode() in meta
    func, args, _ = loads(meta, buffers, flags)
    assert func is script_double or func.qualified_name == script_double.qualified_name
    assert torch.equal(func(*args), torch.full((1,), 2.0))


def test_async_script_function_is_sent_marked_async() -> None:
    """@async_execution over a ScriptFunction is sent as the ScriptFunction marked async (the
    decorator's wrapper cannot be pickled by reference)."""
    target = as_rpc_target(script_later)
    assert isinstance(target, AsyncScriptFunction)
    func = loads(*dumps(target))
    assert func._wrapped_async_rpc_function is not None
    assert torch.equal(func(torch.ones(1)).wait(), torch.full((1,), 2.0))
    assert as_rpc_target(script_double) is script_double


def test_unknown_script_function_names_itself() -> None:
    """A name this process cannot find raises AttributeError naming it (the callee reports it
    as a function missing on its side)."""
    with pytest.raises(AttributeError, match=re.escape("__torch__.nowhere.nothing is not defined")):
        script_function("__torch__.nowhere.nothing")


# -- RRef[T] parameters (issue 23, item 8) -----------------------------------------------------
@torch.jit.script
def script_rref_add(rref: TorchRRef[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    return rref.to_here() + x


@torch.jit.script
def script_rrefs_sum(rrefs: list[TorchRRef[torch.Tensor]]) -> torch.Tensor:
    total = torch.zeros(2)
    for rref in rrefs:
        total = total + rref.to_here()
    return total


LIMIT = "TorchScript cannot take distgrad RRefs"


def _script_calls_with_rrefs(rank: int) -> list[tuple[str, str, float]]:
    rref = rpc.remote("worker1", torch.add, (torch.ones(2), 1))
    x = torch.ones(2)
    calls = {
        "rpc_sync": lambda: rpc.rpc_sync("worker1", script_rref_add, (rref, x)),
        "rpc_async": lambda: rpc.rpc_async("worker1", script_rref_add, (rref, x)),
        "remote": lambda: rpc.remote("worker1", script_rref_add, (rref, x)),
        "kwargs": lambda: rpc.rpc_sync("worker1", script_rref_add, (), {"rref": rref, "x": x}),
        "in_a_list": lambda: rpc.rpc_sync("worker1", script_rrefs_sum, ([rref, rref],)),
        "to_self": lambda: rpc.rpc_sync("worker0", script_rref_add, (rref, x)),
    }
    seen = []
    for name, call in calls.items():
        start = time.monotonic()
        try:
            call()
        except NotImplementedError as exc:
            seen.append((name, str(exc), time.monotonic() - start))
        else:
            seen.append((name, "no error", 0.0))
    # without an RRef, script functions are called as before; the value can be passed
    value = rpc.rpc_sync("worker1", script_double, (rref.to_here(),))
    seen.append(("value", str(value.tolist()), 0.0))
    return seen


def test_a_script_function_with_an_rref_argument_fails_at_the_call() -> None:
    """rpc_sync / rpc_async / remote of a TorchScript function given a distgrad RRef (as an
    argument, a keyword, inside a list; to a peer or to itself) raise one NotImplementedError
    naming the limit at the call, at once -- nothing is sent, nothing waits (torch runs them
    under its own agent; distgrad cannot, and before raised TorchScript's type error on the
    callee)."""
    with open_world(2) as world:
        seen = world.run(_script_calls_with_rrefs, ranks=[0])[0]
    assert seen[-1] == ("value", "[4.0, 4.0]", 0.0)
    for name, message, elapsed in seen[:-1]:
        assert LIMIT in message and "__torch__." in message, (name, message)
        assert "rref.to_here()" in message and elapsed < 1.0, (name, message, elapsed)


def _remote_modules(rank: int) -> list[str]:
    messages = []
    for make in (
        lambda: RemoteModule("worker1/cpu", torch.nn.Linear, (2, 2), _module_interface_cls=object),
        lambda: RemoteModule.init_from_module_rref(
            "worker1/cpu", rpc.RRef(torch.nn.Linear(2, 2)), _module_interface_cls=object
        ),
    ):
        try:
            make()
        except NotImplementedError as exc:
            messages.append(str(exc))
    return messages


def test_a_torchscript_remote_module_fails_with_the_same_error() -> None:
    """RemoteModule's TorchScript paths (``_module_interface_cls`` in the constructor, as
    torch's takes it, and in ``init_from_module_rref``) raise the same NotImplementedError."""
    with open_world(2) as world:
        messages = world.run(_remote_modules, ranks=[0])[0]
    assert len(messages) == 2
    assert all(LIMIT in message and "RemoteModule" in message for message in messages)
