"""The allow-list (``allowed_calls`` / ``allowed_classes``) on in-memory worlds: distgrad's own
features work under a list of the user's functions only; ``eval``, ``os.system``,
``subprocess.Popen`` and a class outside the list, sent by a member of the group, are refused
before anything runs or is imported, with an error naming what and why; the worker keeps
serving and counts the refusals; bad lists fail when the guard is made."""

from __future__ import annotations

import os
import pickle
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

import distgrad.autograd as dist_autograd
import distgrad.rpc as rpc
from distgrad._rpc._core import current_agent
from distgrad._testing._world import open_world, world_options
from distgrad._wire._choice import current_guard
from distgrad._wire._guard import Guard, RefusedError
from distgrad.nn import RemoteModule
from distgrad.optim import DistributedOptimizer

HERE = __name__


def user_mul(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return x * y


def user_echo(x: Any) -> Any:
    return x


def user_rref_sum(ref: Any) -> torch.Tensor:
    return ref.to_here().sum()


class Point:
    def __init__(self, x: float) -> None:
        self.x = x


class Outside:
    """A class no list names."""


def _strict_options(**extra: Any) -> Any:
    options = world_options()
    options.allowed_calls = [user_mul, f"{HERE}.user_echo", user_rref_sum, "torch.add"]
    options.allowed_classes = [Point, "torch.nn.Linear", "torch.optim.SGD", *extra.get("more", [])]
    return options


def test_distgrads_own_features_work_under_a_list_of_the_users_functions() -> None:
    """RRefs (remote, to_here, an RRef argument), distributed autograd, RemoteModule and the
    distributed optimizer all run under a list that names only the user's functions and
    classes; the list is in force in the worlds' agents and gone after shutdown."""

    def body(rank: int) -> Any:
        if rank != 0:
            return None
        assert current_guard() is not None
        w = torch.tensor([1.0, -2.0, 3.0], requires_grad=True)
        with dist_autograd.context() as ctx:
            out = rpc.rpc_sync("worker1", user_mul, (w, w))
            dist_autograd.backward(ctx, [out.sum()])
            grad = dist_autograd.get_gradients(ctx)[w]
        ref = rpc.remote("worker1", torch.add, (torch.ones(2), 1))
        total = rpc.rpc_sync("worker1", user_rref_sum, (ref,))
        point = rpc.rpc_sync("worker1", user_echo, (Point(2.5),))
        module = RemoteModule("worker1/cpu", torch.nn.Linear, (3, 1))
        x = torch.ones(2, 3)
        with dist_autograd.context() as ctx:
            loss = module(x).sum()
            dist_autograd.backward(ctx, [loss])
            optimizer = DistributedOptimizer(torch.optim.SGD, module.remote_parameters(), lr=0.1)
            before = [p.to_here().clone() for p in module.remote_parameters()]
            optimizer.step(ctx)
            after = [p.to_here() for p in module.remote_parameters()]
        return grad, ref.to_here(), total, point.x, before, after

    with open_world(2, options=_strict_options()) as world:
        grad, value, total, x, before, after = world.run(body)[0]
    assert current_guard() is None
    assert torch.equal(grad, torch.tensor([2.0, -4.0, 6.0]))
    assert torch.equal(value, torch.full((2,), 2.0)) and total.item() == 4.0 and x == 2.5
    assert not torch.equal(before[0], after[0])  # the optimizer stepped the remote weights


def test_eval_os_system_popen_and_classes_outside_the_list_are_refused(tmp_path: Path) -> None:
    """A member sends ``eval``, ``os.system``, ``subprocess.Popen`` and a class outside the
    list: each is refused with an error naming it and the rule, nothing runs (the file the
    command would create is not there), the connection stays up and the worker keeps
    serving; the refusals are counted."""
    marker = tmp_path / "ran"
    attempts: list[tuple[Any, tuple[Any, ...]]] = [
        (eval, ("1 + 1",)),
        (os.system, (f"touch {marker}",)),
        (subprocess.Popen, (["touch", str(marker)],)),
        (user_echo, (Outside(),)),
        (user_echo, (pickle.loads,)),
        (rpc.shutdown, ()),  # distgrad's public API is not an internal handler
    ]

    def body(rank: int) -> Any:
        if rank != 0:
            return None
        messages = []
        for func, args in attempts:
            with pytest.raises(RefusedError) as info:
                rpc.rpc_sync("worker1", func, args)
            messages.append(str(info.value))
        still = rpc.rpc_sync("worker1", user_mul, (torch.ones(2), torch.ones(2)))
        agent = current_agent()
        assert agent is not None
        return messages, still

    with open_world(2, options=_strict_options()) as world:
        messages, still = world.run(body)[0]
        stats = world.agents[1].agent_statistics()
    assert not marker.exists()
    assert torch.equal(still, torch.ones(2))
    for message, name in zip(
        messages,
        ("builtins.eval", "system", "subprocess.Popen", "Outside", "loads", "shutdown"),
        strict=True,
    ):
        assert name in message and "allow-list" in message, message
        assert "allowed_calls" in message
    assert stats.requests_refused == len(attempts)


def test_lists_that_name_nothing_fail_when_made() -> None:
    """A dotted name that does not exist, a module named without ``.*``, a prefix whose
    module cannot be imported, or an entry of the wrong type fail at once, naming it."""
    with pytest.raises(ValueError, match=r"'no_such_pkg.f', which does not exist"):
        Guard(["no_such_pkg.f"])
    with pytest.raises(ValueError, match=r"'os.path'.*is a module: use 'pkg.\*'"):
        Guard(["os.path"])
    with pytest.raises(ValueError, match="'nowhere_pkg' cannot be imported"):
        Guard([], ["nowhere_pkg.*"])
    with pytest.raises(TypeError, match="neither a callable"):
        Guard([42])
    with pytest.raises(ValueError, match="does not exist"):
        options = world_options()
        options.allowed_calls = ["torch.no_such_op"]
        with open_world(1, options=options):
            pass
    assert current_guard() is None


def test_the_guard_resolves_only_what_it_allows() -> None:
    """Unpickling under a guard: allowed names and prefixes resolve; a module object, a
    dunder through ``getattr``, and a module not loaded and not listed (never imported) are
    refused; torch's values and builtin ops named by the list go through."""
    guard = Guard([user_echo, "torch.add"], ["collections.*"])
    load = pickle.Unpickler.find_class.__get__(pickle.Unpickler(__import__("io").BytesIO()))
    assert guard.find_class(HERE, "user_echo", load) is user_echo
    assert guard.find_class("collections", "ChainMap", load).__name__ == "ChainMap"
    assert guard.find_class("torch", "float16", load) is torch.float16
    safe_getattr = guard.find_class("builtins", "getattr", load)
    assert safe_getattr(torch._C._VariableFunctionsClass, "add") is torch.add
    with pytest.raises(RefusedError, match="__subclasses__"):
        safe_getattr(Point, "__subclasses__")
    with pytest.raises(RefusedError, match=r"_VariableFunctionsClass\.mul"):
        safe_getattr(torch._C._VariableFunctionsClass, "mul")
    with pytest.raises(RefusedError, match=r"os\.path"):
        guard.find_class("os", "path", load)
    with pytest.raises(RefusedError, match="to import for antigravity"):
        guard.find_class("antigravity", "fly", load)
    assert "antigravity" not in __import__("sys").modules
    assert guard.refused["os.path"] == 1


def test_elastic_joins_and_leaves_work_under_the_list() -> None:
    """A dynamic group whose members allow only the user's functions: a member joins (the
    membership protocol's messages are distgrad's own), is called, and leaves; calls to the
    others keep working."""
    with open_world(2, options=_strict_options(), dynamic=True) as world:
        rank = world.join()
        value = world.run_on(
            0, lambda: rpc.rpc_sync(f"worker{rank}", user_mul, (torch.ones(2), torch.ones(2)))
        )
        world.leave(rank)
        after = world.run_on(0, lambda: rpc.rpc_sync("worker1", user_echo, (5,)))
    assert torch.equal(value, torch.ones(2)) and after == 5
