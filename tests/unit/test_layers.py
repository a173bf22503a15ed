"""The RPC layer's one hook protocol (``_rpc._core._layer``): registration order, idempotence,
roles, lifecycle hooks, a failing layer; and torch is patched only once profiling can be used."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import pytest
import torch

import distgrad.autograd  # noqa: F401  (registers its layer)
import distgrad.rpc as rpc
from distgrad._autograd._layer import AutogradLayer
from distgrad._profiler._layer import ProfilingLayer
from distgrad._rpc._core import _layer
from distgrad._rpc._core._agent import RpcAgent
from distgrad._rpc._core._layer import RpcLayer, register_layer, unregister_layer
from distgrad._rpc._rrefs._layer import RRefLayer
from distgrad._testing._world import open_world


class Probe(RpcLayer):
    name: ClassVar[str] = "probe"

    def __init__(self, log: list[str], tag: str = "probe") -> None:
        self.log = log
        self.tag = tag

    def on_agent_start(self, agent: RpcAgent) -> None:
        self.log.append(f"{self.tag} start {agent.worker_info.name}")

    def on_peer_failure(self, agent: RpcAgent, worker: int, error: Exception) -> None:
        self.log.append(f"{self.tag} lost {worker} at {agent.worker_info.name}")


class Second(Probe):
    name: ClassVar[str] = "second"


@pytest.fixture(autouse=True)
def restore_layers() -> Iterator[None]:
    before = _layer.layers()
    yield
    for layer in _layer.layers():
        unregister_layer(layer.name)
    for layer in before:
        register_layer(layer)
    assert _layer.layers() == before


def add(a: int, b: int) -> int:
    return a + b


def test_distgrad_registers_autograd_profiler_and_rrefs_once() -> None:
    """Importing the public modules registers one autograd, one profiling and one RRef layer,
    each holding its role, and the metrics endpoint's (no role)."""
    names = [layer.name for layer in _layer.layers()]
    assert sorted(names) == ["autograd", "observe", "profiler", "rrefs"]
    assert isinstance(_layer.call_recorder(), AutogradLayer)
    assert isinstance(_layer.call_profiler(), ProfilingLayer)
    assert isinstance(_layer.reference_tracker(), RRefLayer)


def test_registration_keeps_order_and_is_idempotent() -> None:
    """Layers are kept in registration order; registering again changes nothing, and a layer
    of the same name replaces the old one in place."""
    log: list[str] = []
    first, second = Probe(log), Second(log)
    register_layer(first)
    register_layer(second)
    register_layer(first)
    assert _layer.layers()[-2:] == (first, second)
    replacement = Probe(log, "replacement")
    register_layer(replacement)
    assert _layer.layers()[-2:] == (replacement, second)
    assert unregister_layer("probe") is replacement
    assert unregister_layer("probe") is None
    assert first not in _layer.layers()


def test_a_role_has_one_holder() -> None:
    """A second layer that claims a held role is refused, and the registry is unchanged."""

    class OtherRecorder(RpcLayer):
        name: ClassVar[str] = "other-recorder"
        records_calls: ClassVar[bool] = True

    before = _layer.layers()
    with pytest.raises(ValueError, match="only one RPC layer may have records_calls"):
        register_layer(OtherRecorder())
    assert _layer.layers() == before
    with pytest.raises(TypeError, match="must be an RpcLayer"):
        register_layer(object())  # type: ignore[arg-type]


def test_lifecycle_hooks_run_in_order_on_the_agents_threads() -> None:
    """Every layer hears of each agent's start (in registration order) and of a lost peer."""
    log: list[str] = []
    register_layer(Probe(log))
    register_layer(Second(log, "second"))
    with open_world(2) as world:
        starts = ["probe start worker0", "second start worker0"]
        assert log == [*starts, "probe start worker1", "second start worker1"]
        assert world.run(lambda rank: rpc.rpc_sync(f"worker{1 - rank}", add, (rank, 1))) == [
            1,
            2,
        ]
        world.kill(1)
        deadline = time.monotonic() + 10
        while len([e for e in log if "lost" in e]) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
    assert [e for e in log if "lost" in e][:2] == [
        "probe lost 1 at worker0",
        "second lost 1 at worker0",
    ]


def test_a_graceful_shutdown_tells_every_layer() -> None:
    """``on_shutdown`` runs on each worker of a graceful shutdown, not on an abrupt stop."""
    log: list[str] = []

    class Shutdown(RpcLayer):
        name: ClassVar[str] = "shutdown-probe"

        def on_shutdown(self, agent: RpcAgent) -> None:
            log.append(agent.worker_info.name)

    register_layer(Shutdown())
    with open_world(2):
        pass
    assert sorted(log) == ["worker0", "worker1"]
    with pytest.raises(ValueError), open_world(2):  # (an error in the block: stopped abruptly)
        raise ValueError("abrupt")
    assert len(log) == 2


def test_a_layer_that_fails_to_start_fails_the_start_clearly() -> None:
    """``on_agent_start`` raising fails the start with an error naming the layer."""

    class Broken(RpcLayer):
        name: ClassVar[str] = "broken"

        def on_agent_start(self, agent: RpcAgent) -> None:
            raise ValueError("no luck")

    register_layer(Broken())
    failed = pytest.raises(RuntimeError, match="RPC layer 'broken' failed to start")
    with failed as info, open_world(2):
        pass
    assert isinstance(info.value.__cause__, ValueError)


def test_a_layer_that_fails_on_peer_failure_does_not_stop_the_others() -> None:
    """An exception in one layer's ``on_peer_failure`` is logged; later layers still run and
    calls keep working."""
    log: list[str] = []
    heard = threading.Event()

    class Raises(RpcLayer):
        name: ClassVar[str] = "raises"

        def on_peer_failure(self, agent: RpcAgent, worker: int, error: Exception) -> None:
            raise ValueError("oops")

    class Hears(Probe):
        def on_peer_failure(self, agent: RpcAgent, worker: int, error: Exception) -> None:
            log.append(f"lost {worker}")
            heard.set()

    register_layer(Raises())
    register_layer(Hears(log))
    with open_world(3) as world:
        assert world.run_on(0, rpc.rpc_sync, "worker2", add, (1, 1)) == 2  # (a connection)
        world.kill(2)
        assert heard.wait(10)
        assert world.run_on(0, rpc.rpc_sync, "worker1", add, (2, 3)) == 5
    assert "lost 2" in log


def test_the_call_path_hooks_of_the_recorder_are_used() -> None:
    """The recording role's hooks see calls: a substitute recorder records what it is shown."""
    seen: list[int] = []

    class Recorder(RpcLayer):
        name: ClassVar[str] = "autograd"  # replaces distributed autograd in place
        records_calls: ClassVar[bool] = True

        def active(self) -> bool:
            return True

        def outgoing_request(
            self, dst: int, tensors: list[torch.Tensor], force: bool
        ) -> _layer.CallRecord | None:
            seen.append(dst)
            return None

    register_layer(Recorder())
    with open_world(2) as world:
        result = world.run_on(0, rpc.rpc_sync, "worker1", torch.add, (torch.ones(2), 1))
    assert torch.equal(result, torch.full((2,), 2.0))
    assert seen == [1]


_PATCHED = (  # (those this torch has: _ensure_function_events is torch 2.5's)
    "torch.autograd.profiler.profile._start_trace",
    "torch.autograd.profiler.profile.__exit__",
    "torch.autograd.profiler.profile._ensure_function_events",
    "torch.autograd.profiler_legacy.profile._start_trace",
    "torch.autograd.profiler_legacy.profile.__exit__",
)

_PROBE = f"""
import functools, sys, torch, torch.autograd.profiler, torch.autograd.profiler_legacy
names = {_PATCHED!r}
def get(name):
    obj = sys.modules["torch"]
    for part in name.split(".")[1:]:
        obj = getattr(obj, part)
    return obj
def exists(name):
    owner, _, attr = name.rpartition(".")
    return hasattr(get(owner), attr)
names = [name for name in names if exists(name)]
before = {{name: get(name) for name in names}}
import distgrad.rpc, distgrad.autograd, distgrad.profiler
assert all(get(name) is before[name] for name in names), "patched at import"
if sys.argv[1] == "agent":  # a torch-style program: init_rpc, then torch's own profiler
    from distgrad._testing._world import open_world
    with open_world(2) as world:
        assert all(get(name) is not before[name] for name in names), "not patched at start"
        def step(rank):
            with torch.autograd.profiler.profile() as prof:
                distgrad.rpc.rpc_sync(f"worker{{1 - rank}}", torch.add, (torch.ones(2), 1))
            return [e.name for e in prof.function_events]
        names_seen = world.run_on(0, step, 0)
    assert any("#remote_op: aten::add" in name for name in names_seen), names_seen
else:
    with distgrad.profiler.profile() as prof:
        torch.ones(2).add(1)
    assert any(e.name == "aten::add" for e in prof.events())
assert all(get(name) is not before[name] for name in names), "not patched when used"
assert all(get(name).__wrapped__ is before[name] for name in names)
print("ok")
"""


@pytest.mark.parametrize("first_use", ["profile", "agent"])
def test_importing_distgrad_patches_nothing_in_torch_until_profiling(first_use: str) -> None:
    """After ``import distgrad.rpc, distgrad.autograd`` torch's profiler methods are the
    originals; making a ``distgrad.profiler.profile``, or starting an agent (then torch's own
    profiler records remote events), wraps them, and profiling works."""
    src = str(Path(__file__).resolve().parents[2] / "src")
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, first_use],
        env={**os.environ, "PYTHONPATH": src},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


_DEGRADED_PROBE = """
import logging, sys, torch, torch.autograd.profiler_legacy as legacy
del legacy.profile._start_trace  # as on a torch without this internal
logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="%(name)s: %(message)s")
import distgrad.rpc
from distgrad._testing._world import open_world
def step(rank):
    with torch.autograd.profiler.profile() as prof:
        result = distgrad.rpc.rpc_sync("worker1", torch.add, (torch.ones(2), 1))
    return result, [e.name for e in prof.function_events]
for _ in range(2):  # a second agent start warns no more
    with open_world(2) as world:
        result, names = world.run_on(0, step, 0)
    assert torch.equal(result, torch.full((2,), 2.0))
    assert any(name.startswith("rpc_sync#aten::add") for name in names), names
print("ok")
"""


def test_a_missing_torch_profiler_internal_turns_remote_events_off_not_rpc() -> None:
    """On a torch that lacks a profiler method distgrad wraps (simulated: deleted), agents
    start, calls (profiled ones included) work, and one warning names what is missing."""
    src = str(Path(__file__).resolve().parents[2] / "src")
    out = subprocess.run(
        [sys.executable, "-c", _DEGRADED_PROBE],
        env={**os.environ, "PYTHONPATH": src},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    warnings = [line for line in lines if line.startswith("distgrad.profiler:")]
    assert len(warnings) == 1, out.stdout
    assert "lacks torch.autograd.profiler_legacy.profile._start_trace" in warnings[0]
    assert "RPC itself is not affected" in warnings[0]
    assert lines[-1] == "ok"
