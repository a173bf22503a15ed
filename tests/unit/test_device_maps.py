"""Device maps without a GPU: options, the init-time validation, reverse maps and default
devices side by side with torch's own functions (CPU wheel), and the routing of one tensor
with torch's messages (device names need no GPU: ``torch.device("cuda:3")`` is a value)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import distgrad.rpc as rpc
from distgrad._config import CUDA_IPC_THRESHOLD
from distgrad._devices._backend import DeviceBackend
from distgrad._devices._maps import (
    CPU_ONLY,
    DevicePlan,
    default_devices,
    maps_from_record,
    maps_to_record,
    plan_devices,
    reverse_maps,
    route,
    validate_device_maps,
)
from distgrad._rpc._core._codec import Codec, DeviceRouter
from distgrad._rpc._core._worker_info import WorkerInfo

torch_rpc = pytest.importorskip("torch.distributed.rpc")
backend_registry = pytest.importorskip("torch.distributed.rpc.backend_registry")
needs_torch_options = pytest.mark.skipif(
    not hasattr(torch_rpc, "TensorPipeRpcBackendOptions"), reason="torch built without RPC"
)

D = torch.device


def _outcome(fn: Any) -> tuple[str, str]:
    try:
        value = fn()
    except Exception as exc:
        return type(exc).__name__, str(exc)
    if isinstance(value, dict):  # torch's C++ map orders entries its own way
        value = {
            k: sorted(v.items(), key=str) if isinstance(v, dict) else v for k, v in value.items()
        }
    return "ok", repr(value)


def _set_twice(first: dict[str, str], second: dict[str, str]) -> Any:
    def run(kind: Any) -> Any:
        options = kind()
        options.set_device_map("w1", first)
        options.set_device_map("w1", second)
        return options.device_maps

    return run


def _set_devices(kind: Any) -> Any:
    options = kind()
    options.set_devices(["cuda:1"])
    return options.devices


OPTION_CASES: dict[str, Any] = {
    "str map": lambda kind: kind(device_maps={"w1": {"cuda:0": "cuda:1"}}).device_maps,
    "cpu entry": lambda kind: kind(device_maps={"w1": {"cpu": "cuda:1"}}).device_maps,
    "device objects": lambda kind: (
        kind(device_maps={"w1": {D("cuda", 0): D("cuda:1")}}).device_maps
    ),
    "int on a CPU build": lambda kind: kind(device_maps={"w1": {0: 1}}).device_maps,
    "int devices": lambda kind: kind(devices=[0]).devices,
    "str devices": lambda kind: kind(devices=["cuda:0", "cuda:2"]).devices,
    "cpu in devices": lambda kind: kind(devices=["cpu"]),
    "meta in devices": lambda kind: kind(devices=["meta"]),
    "negative index": lambda kind: kind(device_maps={"w1": {D("cuda", -1): "cuda:1"}}),
    "bad index string": lambda kind: kind(device_maps={"w1": {"cuda:-1": "cuda:1"}}),
    "two to one": lambda kind: kind(device_maps={"w1": {"cuda:0": "cuda:1", "cuda:1": "cuda:1"}}),
    "one to two over calls": _set_twice({"cuda:0": "cuda:0"}, {"cuda:0": "cuda:1"}),
    "two to one over calls (passes, fails at init)": _set_twice(
        {"cuda:0": "cuda:0"}, {"cuda:1": "cuda:0"}
    ),
    "set_devices": _set_devices,
    "bad device string": lambda kind: kind(devices=["gpu:0"]),
    "duplicated devices (checked at init)": lambda kind: kind(devices=["cuda:0", "cuda:0"]).devices,
}


@needs_torch_options
@pytest.mark.parametrize("case", sorted(OPTION_CASES))
def test_options_match_torch(case: str) -> None:
    """Each device option, good or bad, gives what torch's TensorPipeRpcBackendOptions gives on
    this wheel: the same values, or the same exception type and message."""
    if case.startswith("int") and torch.cuda.is_available():
        pytest.skip("integer ids mean CUDA devices where CUDA is available")
    fn = OPTION_CASES[case]
    assert _outcome(lambda: fn(rpc.TensorPipeRpcBackendOptions)) == _outcome(
        lambda: fn(torch_rpc.TensorPipeRpcBackendOptions)
    )


def _group(
    **maps: dict[str, dict[str, str]],
) -> dict[str, dict[str, dict[torch.device, torch.device]]]:
    return {
        name: {to: {D(k): D(v) for k, v in m.items()} for to, m in targets.items()}
        for name, targets in maps.items()
    }


VALIDATION_CASES: dict[str, tuple[dict[str, int], Any, dict[str, list[str]], bool]] = {
    "valid": ({"a": 2, "b": 2}, _group(a={"b": {"cuda:0": "cuda:1"}}, b={}), {}, True),
    "cpu entries": ({"a": 0, "b": 1}, _group(a={"b": {"cpu": "cuda:0"}}, b={}), {}, True),
    "missing worker": ({"a": 1, "b": 1}, _group(a={"c": {"cuda:0": "cuda:0"}}, b={}), {}, True),
    "missing worker, dynamic": (
        {"a": 1, "b": 1},
        _group(a={"c": {"cuda:0": "cuda:0"}}, b={}),
        {},
        False,
    ),
    "source index": ({"a": 1, "b": 2}, _group(a={"b": {"cuda:1": "cuda:0"}}, b={}), {}, True),
    "target index": ({"a": 2, "b": 1}, _group(a={"b": {"cuda:0": "cuda:1"}}, b={}), {}, True),
    "no GPUs at all": ({"a": 0, "b": 0}, _group(a={"b": {"cuda:0": "cuda:0"}}, b={}), {}, True),
    "duplicated targets": (
        {"a": 2, "b": 2},
        _group(a={"b": {"cuda:0": "cuda:0", "cuda:1": "cuda:1"}}, b={}),
        {},
        True,
    ),
    "duplicated devices": ({"a": 2, "b": 2}, _group(a={}, b={}), {"a": ["cuda:0", "cuda:0"]}, True),
    "devices index": ({"a": 1, "b": 2}, _group(a={}, b={}), {"a": ["cuda:1"]}, True),
    "unexpected source": (
        {"a": 2, "b": 2},
        _group(a={"b": {"cuda:1": "cuda:0"}}, b={}),
        {"a": ["cuda:0"]},
        True,
    ),
    "unexpected target": (
        {"a": 2, "b": 2},
        _group(a={"b": {"cuda:0": "cuda:1"}}, b={}),
        {"b": ["cuda:0"]},
        True,
    ),
}


def _duplicate_targets(maps: Any) -> Any:
    # two sources to one target (what set_device_map lets through; a dict cannot hold it
    # twice in a literal, so build it)
    return maps


@pytest.mark.parametrize("case", sorted(VALIDATION_CASES))
def test_validation_matches_torch(case: str) -> None:
    """distgrad's init-time validation raises exactly torch's ValueError (or passes) for each
    group: counts, maps and ``devices`` as every worker publishes them."""
    counts, maps, devices_str, static = VALIDATION_CASES[case]
    if case == "duplicated targets":
        maps["a"]["b"] = {D("cuda:0"): D("cuda:0"), D("cuda:1"): D("cuda:0")}
    names = list(counts)
    devices = {n: [D(d) for d in devices_str.get(n, [])] for n in names}
    ours = _outcome(
        lambda: validate_device_maps(names, counts, maps, devices, is_static_group=static)
    )
    theirs = _outcome(
        lambda: backend_registry._validate_device_maps(
            names, counts, maps, devices, is_static_group=static
        )
    )
    assert ours == theirs
    if case in ("valid", "cpu entries", "missing worker, dynamic"):
        assert ours[0] == "ok"
    else:
        assert ours[0] == "ValueError"


def test_reverse_maps_and_default_devices_match_torch() -> None:
    """Reverse maps invert each peer's map to this worker, and default devices are the
    sources of this worker's maps and reverse maps less the CPU, sorted: as torch derives
    them."""
    maps = _group(
        a={"b": {"cuda:0": "cuda:1", "cpu": "cuda:0"}},
        b={"a": {"cuda:1": "cuda:2"}, "c": {"cuda:3": "cpu"}},
        c={"b": {"cpu": "cuda:3"}},
    )
    names = ["a", "b", "c"]
    for me in names:
        ours = reverse_maps(me, names, maps)
        assert ours == backend_registry._create_reverse_mapping(me, names, maps)
        for given in ([], [D("cuda:5"), D("cuda:4")]):
            assert default_devices(given, maps[me], ours) == backend_registry._create_device_list(
                given, maps[me], ours
            )
    assert default_devices([], maps["b"], reverse_maps("b", names, maps)) == [
        D("cuda:0"),
        D("cuda:1"),
        D("cuda:3"),
    ]


def test_plan_from_published_records() -> None:
    """What workers publish round-trips through JSON, and each plan holds its own maps, the
    inverse of every map to it and its devices; a bad group fails alike on every worker."""
    published = {
        "a": maps_to_record(2, {"b": {D("cuda:0"): D("cuda:1"), D("cpu"): D("cuda:0")}}, []),
        "b": maps_to_record(2, {}, []),
    }
    assert maps_from_record(published["a"])[1] == {
        "b": {D("cuda:0"): D("cuda:1"), D("cpu"): D("cuda:0")}
    }
    plan_b = plan_devices("b", ["a", "b"], published)
    assert plan_b.maps == {} and plan_b.reverse == {
        "a": {D("cuda:1"): D("cuda:0"), D("cuda:0"): D("cpu")}
    }
    assert plan_b.devices == [D("cuda:0"), D("cuda:1")] and plan_b.used
    assert plan_devices("a", ["a", "b"], published).devices == [D("cuda:0")]
    assert not plan_devices("a", ["a"], {"a": None}).used  # an older peer published none
    published["b"] = maps_to_record(1, {}, [])
    for me in ("a", "b"):
        with pytest.raises(ValueError, match=r"^Node a has target devices with invalid indices"):
            plan_devices(me, ["a", "b"], published)


def test_tensors_between_workers_on_one_gpu_are_shared_by_ipc() -> None:
    """Workers publish the UUID of each GPU their maps name; a map entry whose two ends are one
    physical GPU (same UUID: same host, same device, whatever each worker numbers it) is
    exchanged by CUDA IPC (the backend's ``stage_shared``) from ``CUDA_IPC_THRESHOLD`` bytes,
    anything else is staged; a
    worker that offered none, or the worker itself, gets no IPC; a joiner's offer counts."""
    published = {
        "a": maps_to_record(
            2,
            {"b": {D("cuda:0"): D("cuda:1"), D("cuda:1"): D("cuda:0")}},
            [],
            {"cuda:0": "GPU-x", "cuda:1": "GPU-y"},
        ),
        "b": maps_to_record(2, {"a": {D("cuda:1"): D("cuda:0")}}, [], {"cuda:1": "GPU-x"}),
        "c": maps_to_record(2, {}, []),
    }
    assert published["c"].get("gpus") is None  # nothing offered: the record is as before
    plan_a = plan_devices("a", ["a", "b", "c"], published)
    plan_b = plan_devices("b", ["a", "b", "c"], published)
    a_to_b = plan_a.maps["b"]
    assert plan_a.ipc_pairs("b", a_to_b) == {(D("cuda:0"), D("cuda:1"))}  # GPU-y is not b's
    assert plan_b.ipc_pairs("a", plan_b.maps["a"]) == {(D("cuda:1"), D("cuda:0"))}
    assert plan_b.ipc_pairs("a", plan_b.reverse["a"]) == {(D("cuda:1"), D("cuda:0"))}
    assert plan_a.ipc_pairs("c", {D("cuda:0"): D("cuda:0")}) == frozenset()
    assert plan_a.ipc_pairs("a", {D("cuda:0"): D("cuda:0")}) == frozenset()
    assert plan_a.ipc_pairs("b", None) == frozenset()

    class Recording(DeviceBackend):
        calls: list[str] = []

        def stage(self, tensor: torch.Tensor, target: torch.device) -> Any:
            self.calls.append(f"stage {target}")
            return super().stage(tensor, target)

        def stage_shared(self, tensor: torch.Tensor, target: torch.device) -> Any:
            self.calls.append(f"shared {target}")
            return super().stage(tensor, target)

    # the routing, with CPU tensors standing for a GPU (a plan that offers "cpu" as one)
    plan = DevicePlan(gpus={"a": {D("cpu"): "GPU-x"}, "b": {D("cuda:1"): "GPU-x"}}, me="a")
    backend = Recording()
    big = torch.ones(CUDA_IPC_THRESHOLD // 4)
    DeviceRouter("Request", "b", {D("cpu"): D("cuda:1")}, plan, backend)(big)
    DeviceRouter("Request", "b", {D("cpu"): D("cuda:1")}, plan, backend)(big[:-1])  # too small
    DeviceRouter("Request", "b", {D("cpu"): D("cuda:0")}, plan, backend)(big)
    DeviceRouter("Request", "c", {D("cpu"): D("cuda:1")}, plan, backend)(big)
    assert backend.calls == ["shared cuda:1", "stage cuda:1", "stage cuda:0", "stage cuda:1"]


def test_route_messages_are_torchs() -> None:
    """A tensor's target: CPU stays without a ``cpu`` entry and follows one; a device with no
    map, or a map without its device, raises torch's RuntimeError word for word."""
    mapping = {D("cuda:0"): D("cuda:1"), D("cpu"): D("cuda:2")}
    assert route(D("cpu"), None, "Request", "w1") is None
    assert route(D("cpu"), {D("cuda:0"): D("cuda:0")}, "Request", "w1") is None
    assert route(D("cpu"), mapping, "Request", "w1") == D("cuda:2")
    assert route(D("cuda:0"), mapping, "Response", "w1") == D("cuda:1")
    with pytest.raises(RuntimeError) as no_map:
        route(D("cuda:0"), None, "Request", "w1")
    assert str(no_map.value) == (
        f"{CPU_ONLY}Request device mapping is not available for destination w1, but found "
        "tensor on device: cuda:0"
    )
    with pytest.raises(RuntimeError) as missing:
        route(D("cuda:3"), mapping, "Response", "w0")
    assert str(missing.value) == (
        f"{CPU_ONLY}Response device mapping is not available for destination w0 for device "
        "cuda:3 but received a tensor on that device."
    )


class _Staging(DeviceBackend):
    """Records what it is asked to stage (tensor device, target)."""

    def __init__(self) -> None:
        self.staged: list[tuple[str, str]] = []

    def stage(self, tensor: torch.Tensor, target: torch.device) -> Any:
        self.staged.append((str(tensor.device), str(target)))
        return super().stage(torch.zeros(tensor.shape), target)


def test_codec_uses_the_request_map_the_reverse_map_and_a_message_map() -> None:
    """Requests to a peer route by this worker's map to it, responses by the inverse of the
    peer's map to this worker, a gradient message by the map it brings; CPU tensors go through
    the map only where it has a ``cpu`` entry (``routes_cpu``); a callee's output on a device
    outside its ``devices`` fails with torch's message."""
    options = rpc.TensorPipeRpcBackendOptions()
    codec = Codec(options, {1: WorkerInfo("w1", 1)}, str)
    backend = _Staging()
    meta = D("meta")  # stands for a device tensor: it needs no GPU
    plan = DevicePlan(
        maps={"w1": {meta: D("cuda:1")}},
        reverse={"w1": {meta: D("cuda:0"), D("cpu"): D("cuda:3")}},
        devices=[meta],
    )
    codec.set_device_plan(plan, backend)
    tensor = torch.empty(2, device="meta")
    request, response = codec.device_check("Request", 1), codec.device_check("Response", 1)
    assert not request.routes_cpu and response.routes_cpu
    assert request(tensor) is not None and response(tensor) is not None
    assert request(torch.ones(2)) is None  # no cpu entry: stays on the CPU
    assert response(torch.ones(2)) is not None
    override = codec.device_check("Request", 1, {meta: D("cuda:7")})
    assert override(tensor) is not None
    assert backend.staged == [
        ("meta", "cuda:1"),
        ("meta", "cuda:0"),
        ("cpu", "cuda:3"),
        ("meta", "cuda:7"),
    ]
    assert codec.device_check("Request", 1) is request  # cached per direction and peer
    codec.set_device_plan(DevicePlan(reverse=plan.reverse, devices=[D("cuda:0")]), backend)
    with pytest.raises(RuntimeError) as outside:  # a callee's output outside its devices
        codec.device_check("Response", 1)(tensor)
    assert str(outside.value) == (
        "RPC detected that a user-function output tensor on device meta. This device is not "
        "one of the input tensor devices: cuda:0, which is not yet supported. Please file a "
        "feature request issue in PyTorch GitHub repo."
    )
    codec.set_device_plan(DevicePlan(), DeviceBackend())
    with pytest.raises(
        RuntimeError, match="Request device mapping is not available for destination w1"
    ):
        codec.device_check("Request", 1)(tensor)
