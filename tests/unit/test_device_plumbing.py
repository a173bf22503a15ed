"""The device map through every message kind, on in-memory worlds without a GPU: a fake
backend stands for CUDA (it reports two devices, and a tensor that "arrives" on one is a CPU
copy, noted with the receiving worker and the device), and maps with ``cpu`` entries make
CPU tensors travel by the map -- so which map each message used is observable."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

import distgrad.autograd as dist_autograd
import distgrad.rpc as rpc
from distgrad._devices._backend import DeviceBackend, _note
from distgrad._devices._maps import CPU_ONLY
from distgrad._rpc._core._agent import current_agent
from distgrad._rpc._core._functions import on_io_thread
from distgrad._testing._world import open_world, world_options

D = torch.device


class FakeCuda(DeviceBackend):
    """Two fake CUDA devices: arrivals are CPU tensors, recorded as (worker, device)."""

    name = "fake"
    lock = threading.Lock()
    arrived: list[tuple[str, str]] = []
    threads: list[str] = []  # the thread that put each arrival on its device

    def device_count(self) -> int:
        return 2

    def arrive(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        agent = current_agent()
        with self.lock:
            self.arrived.append((agent.worker_info.name if agent else "?", str(device)))
            self.threads.append(threading.current_thread().name)
        out = host.clone()
        _note(device, None, out)
        return out


@pytest.fixture
def fake() -> Any:
    FakeCuda.arrived, FakeCuda.threads = [], []
    yield FakeCuda
    FakeCuda.arrived, FakeCuda.threads = [], []


def _options(maps: dict[str, dict[str, str]]) -> rpc.TensorPipeRpcBackendOptions:
    options = world_options()
    for to, device_map in maps.items():
        options.set_device_map(to, device_map)
    options._device_backend = FakeCuda()  # type: ignore[attr-defined]
    return options


def echo(x: Any) -> Any:
    return x


def twice(x: torch.Tensor) -> torch.Tensor:
    return x * 2


BOTH_WAYS = {"cpu": "cuda:0", "cuda:0": "cpu"}  # CPU tensors go to cuda:0 and come back
BOTH_WAYS_D = {D(k): D(v) for k, v in BOTH_WAYS.items()}


def test_requests_go_by_the_map_and_responses_by_the_reverse(fake: Any) -> None:
    """worker0 -> worker1 routes CPU tensors by worker0's map (they land on cuda:0 there; the
    agent's ``_get_device_map`` says so, as torch's);
    worker1's answer goes by the inverse of that map (back on worker0's ``cpu -> cuda:0``
    entry inverted), never by worker1's own map to worker0 (``cpu -> cuda:1``)."""
    opts = [_options({"worker1": BOTH_WAYS}), _options({"worker0": {"cpu": "cuda:1"}})]
    with open_world(2, options=opts) as world:
        plan0, plan1 = (a.device_plan for a in world.agents)
        assert plan1.reverse == {"worker0": {D("cuda:0"): D("cpu"), D("cpu"): D("cuda:0")}}
        assert world.agents[0]._get_device_map(world.agents[1].worker_info) == BOTH_WAYS_D
        assert world.agents[1]._get_device_map(world.agents[0].worker_info) == {
            D("cpu"): D("cuda:1")
        }
        assert plan0.devices == [D("cuda:0"), D("cuda:1")] and plan1.devices == [D("cuda:0")]

        def program(rank: int) -> Any:
            if rank == 0:
                return rpc.rpc_sync("worker1", twice, (torch.ones(3),))
            return None

        assert torch.equal(world.run(program)[0], torch.full((3,), 2.0))
        assert fake.arrived == [("worker1", "cuda:0"), ("worker0", "cuda:0")]
        fake.arrived.clear()
        out = world.run_on(1, lambda: rpc.rpc_sync("worker0", echo, (torch.ones(2),)))
        assert torch.equal(out, torch.ones(2))
        # worker1's request by its own map (cuda:1 on worker0); worker0's answer by the
        # inverse of worker1's map, which has no cpu *target* entry as a key: stays on the CPU
        assert fake.arrived == [("worker0", "cuda:1")]


def test_async_calls_remote_and_to_here_use_the_maps(fake: Any) -> None:
    """rpc_async, remote() arguments (by the request map) and to_here() (by the reverse map)
    move their tensors as the maps say, with the right values."""
    opts = [_options({"worker1": BOTH_WAYS}), _options({})]
    with open_world(2, options=opts) as world:

        def program() -> Any:
            fut = rpc.rpc_async("worker1", twice, (torch.ones(2),))
            first = fut.wait()
            rref = rpc.remote("worker1", twice, (torch.full((2,), 3.0),))
            return first, rref.to_here()

        first, fetched = world.run_on(0, program)
        assert torch.equal(first, torch.full((2,), 2.0)) and torch.equal(
            fetched, torch.full((2,), 6.0)
        )
        assert fake.arrived.count(("worker1", "cuda:0")) == 2  # rpc_async, remote() args
        assert fake.arrived.count(("worker0", "cuda:0")) == 2  # the async result, to_here()


def test_gradients_go_back_by_the_forward_maps_inverse(fake: Any) -> None:
    """Distributed autograd: the forward request carries worker0's map; worker1's recv function
    keeps its inverse and sends the gradients back by it although worker1 has no map to
    worker0 (torch's RecvRpcBackward); gradients equal local autograd's."""
    opts = [_options({"worker1": BOTH_WAYS}), _options({})]
    with open_world(2, options=opts) as world:

        def program() -> Any:
            w = torch.tensor([1.0, -2.0, 3.0], requires_grad=True)
            with dist_autograd.context() as ctx:
                out = rpc.rpc_sync("worker1", torch.mul, (w, w))
                fake.arrived.clear()
                dist_autograd.backward(ctx, [out.sum()])
                return dist_autograd.get_gradients(ctx)[w], w

        grad, w = world.run_on(0, program)
        assert torch.allclose(grad, 2 * w.detach())
        # the gradient for the response's recv went to worker1 by worker0's own map; worker1's
        # gradient came back by the inverse of the forward's map (cpu -> cuda:0 on worker0)
        assert ("worker1", "cuda:0") in fake.arrived and ("worker0", "cuda:0") in fake.arrived


def test_no_map_errors_are_torchs_and_nothing_waits(fake: Any) -> None:
    """Without maps, a device tensor in a request raises torch's error at once; in a
    response it comes back as that call's error; the agent keeps serving, and neither
    waits for a timeout."""
    with open_world(2, options=world_options(rpc_timeout=30)) as world:

        def program() -> Any:
            started = time.monotonic()
            with pytest.raises(RuntimeError) as request_error:
                rpc.rpc_sync("worker1", echo, (torch.empty(2, device="meta"),))
            assert str(request_error.value) == (
                f"{CPU_ONLY}Request device mapping is not available for destination worker1, "
                "but found tensor on device: meta"
            )
            fut = rpc.rpc_async("worker1", torch.empty, (2,), {"device": "meta"})
            with pytest.raises(RuntimeError) as response_error:
                fut.wait()
            assert (  # as a remote error (torch's tests match it by regex)
                f"{CPU_ONLY}Response device mapping is not available for destination worker0, "
                "but found tensor on device: meta"
            ) in str(response_error.value)
            assert torch.equal(
                rpc.rpc_sync("worker1", twice, (torch.ones(1),)), torch.full((1,), 2.0)
            )
            return time.monotonic() - started

        assert world.run_on(0, program) < 5.0
    assert fake.arrived == []


def test_a_joiners_maps_are_validated_against_the_members(fake: Any) -> None:
    """Dynamic groups: a joiner whose map names a device a member lacks (``cuda:7`` on
    worker0, which has two) is refused with torch's ValueError and the members keep their
    plans; a valid joiner is announced, and then a member's responses to it use the inverse of
    the joiner's map and default devices are derived again."""
    with open_world(2, options=[_options({}), _options({})], dynamic=True) as world:
        agent0 = world.agents[0]
        before = agent0.device_plan
        with pytest.raises(ValueError, match="invalid indices in its device map for worker0"):
            world.join(name="bad", options=_options({"worker0": {"cpu": "cuda:7"}}))
        assert agent0.device_plan == before
        assert "bad" not in [w.name for w in agent0.get_worker_infos()]
        world.kill(2)  # (the refused joiner's agent)
        world.join(name="late", options=_options({"worker0": {"cpu": "cuda:1"}}))
        assert agent0.device_plan.reverse == {"late": {D("cuda:1"): D("cpu")}}
        assert agent0.device_plan.devices == [D("cuda:1")]


def test_staged_tensors_round_trip_through_the_pickler(fake: Any) -> None:
    """A message routed by a ``cpu -> cuda:0`` map, inline and with a tensor table: every
    tensor is staged once (a tensor twice in the message stays one object), values, views'
    values and ``requires_grad`` survive, and the receiver's arrivals name the device."""
    from distgrad._devices import _backend
    from distgrad._devices._maps import DevicePlan
    from distgrad._rpc._core._codec import Codec
    from distgrad._rpc._core._worker_info import WorkerInfo
    from distgrad._wire._pickler import decode, encode

    codec = Codec(world_options(), {1: WorkerInfo("w1", 1)}, str)
    codec.set_device_plan(DevicePlan(maps={"w1": {D("cpu"): D("cuda:0")}}), FakeCuda())
    router = codec.device_check("Request", 1)
    base = torch.arange(12.0).reshape(3, 4)
    weight = torch.ones(2, requires_grad=True)
    payload = {"a": base, "again": base, "view": base.t(), "w": weight, "n": 3}
    previous = _backend.Process.backend
    _backend.install_receiver(FakeCuda())
    try:
        for make_ext in (None, len):
            fake.arrived.clear()
            encoded = encode(payload, make_ext, router)
            ext, got = decode(encoded.meta, [b.raw() for b in encoded.buffers], encoded.flags)
            arrivals = _backend.take_arrivals()
            assert arrivals is not None and list(arrivals.streams) == [D("cuda:0")]
            assert got["again"] is got["a"] and torch.equal(got["a"], base)
            assert torch.equal(got["view"], base.t()) and got["n"] == 3
            assert got["w"].requires_grad and torch.equal(got["w"].detach(), weight.detach())
            assert len(fake.arrived) == 3 == len(arrivals.tensors)  # base, its view, weight
            assert ext == (None if make_ext is None else 3)
    finally:
        _backend.Process.backend = previous


def test_distgrad_objects_survive_torchs_tensor_extraction() -> None:
    """A device-aware future (``rpc_async`` with devices configured) pickles its result with
    torch's ``_extract_tensors`` to find its tensors: an RRef or a RemoteModule in the result is
    skipped there, as torch skips its own RRefs, and the tensors beside them are found; plain
    pickling still refuses both with torch's messages (issue 29, item 2)."""
    import pickle

    from torch._jit_internal import _extract_tensors

    from distgrad.nn import RemoteModule

    def body(rank: int) -> Any:
        if rank != 0:
            return None
        rref = rpc.remote("worker1", torch.add, (torch.ones(2), 1))
        module = RemoteModule("worker1/cpu", torch.nn.Linear, (2, 2))
        t = torch.ones(3)
        found = _extract_tensors([rref, {"module": module, "t": t}, (rref, t)])
        errors = []
        for obj in (rref, module):
            with pytest.raises(RuntimeError) as info:
                pickle.dumps(obj)
            errors.append(str(info.value))
        return found, errors, rref.to_here()

    with open_world(2) as world:
        found, errors, value = world.run(body)[0]
    assert (
        len(found) == 2
        and all(x is found[0] for x in found)
        and torch.equal(found[0], torch.ones(3))
    )
    assert errors == [
        "Can not pickle rref in python pickler, rref can only be pickled when using RPC",
        "Cannot pickle RemoteModule in python pickler. RemoteModule can only be pickled when "
        "using RPC",
    ]
    assert torch.equal(value, torch.full((2,), 2.0))


NOTIFIED: list[tuple[str, float]] = []


@on_io_thread  # as the late gradient messages: run where decoded, in the order sent
def notify_with(x: torch.Tensor) -> None:
    NOTIFIED.append((threading.current_thread().name, float(x.sum()) if x.numel() else -1.0))


def test_device_tensors_in_one_way_messages_never_reach_the_device_on_the_io_thread(
    fake: Any,
) -> None:
    """A one-way message (a gradient for a pass, say) with tensors for a device is decoded off
    the I/O thread, whose copy to a GPU could wait for the GPU's backlog and silence the
    heartbeats; messages that follow it, with or without tensors, keep their order
    (issue 29, item 3)."""
    from distgrad._rpc._core._agent import current_agent

    NOTIFIED.clear()
    opts = [_options({"worker1": BOTH_WAYS}), _options({"worker0": BOTH_WAYS})]
    with open_world(2, options=opts) as world:

        def program() -> Any:
            w = torch.tensor([1.0, -2.0, 3.0], requires_grad=True)
            with dist_autograd.context() as ctx:
                out = rpc.rpc_sync("worker1", torch.mul, (w, w))
                dist_autograd.backward(ctx, [out.sum()])
                grad = dist_autograd.get_gradients(ctx)[w]
            agent = current_agent()
            assert agent is not None
            for i in range(20):  # alternate: with device tensors, without, in one order
                x = torch.full((2,), float(i)) if i % 2 == 0 else torch.tensor([])
                agent.notify(1, notify_with, (x,))
            deadline = time.monotonic() + 10
            while len(NOTIFIED) < 20 and time.monotonic() < deadline:
                time.sleep(0.01)
            return grad, w

        grad, w = world.run_on(0, program)
    assert torch.allclose(grad, 2 * w.detach())
    assert fake.threads and "distgrad-io" not in fake.threads, fake.threads
    assert [v for _, v in NOTIFIED] == [2.0 * i if i % 2 == 0 else -1.0 for i in range(20)]


def _refuse_unpickling() -> None:
    raise ValueError("this object cannot be rebuilt here")


class Unbuildable:
    def __reduce__(self) -> Any:
        return (_refuse_unpickling, ())


def tensor_then_unbuildable() -> Any:
    return [torch.ones(3), Unbuildable()]


def test_a_decode_that_fails_halfway_leaves_no_arrivals_behind(fake: Any) -> None:
    """A response whose tensor reached a device before the rest failed to unpickle: the call
    fails with the cause, and the thread's record of what arrived is cleared (the next
    message's streams and tensors are its own) -- for ``rpc_sync`` and ``rpc_async``."""
    from distgrad._devices._backend import state

    opts = [_options({"worker1": BOTH_WAYS}), _options({})]
    with open_world(2, options=opts) as world:

        def program() -> Any:
            with pytest.raises(Exception, match="cannot be rebuilt"):
                rpc.rpc_sync("worker1", tensor_then_unbuildable)
            after_sync = state.arrivals
            with pytest.raises(Exception, match="cannot be rebuilt"):
                rpc.rpc_async("worker1", tensor_then_unbuildable).wait()
            back = rpc.rpc_sync("worker1", echo, (torch.ones(2),))
            return after_sync, back

        after_sync, back = world.run_on(0, program)
    assert after_sync is None
    assert ("worker0", "cuda:0") in fake.arrived  # the tensor did arrive before the failure
    assert torch.equal(back, torch.ones(2))
