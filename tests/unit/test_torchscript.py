"""Unit tests of TorchScript functions in messages (``distgrad._rpc._core._torchscript``): they
travel by qualified name and come back as the same function."""

from __future__ import annotations

import re

import pytest
import torch

import distgrad.rpc as rpc
from distgrad._rpc._core._torchscript import AsyncScriptFunction, as_rpc_target, script_function
from distgrad._wire._pickler import dumps, loads


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
