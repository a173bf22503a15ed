"""Device maps, the pure part: parsing as torch's options do, the init-time validation with
torch's messages, reverse maps, the default ``devices``, and the routing of one tensor.

Everything here works on ``torch.device`` values only, so it is tested on CPU-only machines
with any device names (``torch.device("cuda:3")`` needs no GPU).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = [
    "CPU",
    "CPU_ONLY",
    "DeviceLike",
    "DeviceMap",
    "DevicePair",
    "DevicePlan",
    "check_one_to_one",
    "default_devices",
    "gpus_from_record",
    "maps_from_record",
    "maps_to_record",
    "plan_devices",
    "reverse_maps",
    "route",
    "to_cuda_device",
    "to_device",
    "validate_device_maps",
]

DeviceLike = int | str | torch.device
DeviceMap = dict[torch.device, torch.device]
CPU = torch.device("cpu")

#: torch's prefix of every "no device map" error
CPU_ONLY = (
    "TensorPipe RPC backend only supports CPU tensors by default, please move your tensors to "
    "CPU before sending them over RPC, or call `set_device_map` on "
    "`TensorPipeRpcBackendOptions` to explicitly configure device mapping. "
)


def to_device(d: DeviceLike) -> torch.device:
    """``torch.device(d)`` as torch's options parse it: an int is the current accelerator's
    index (on a build without one: torch's "Cannot access accelerator device when none is
    available."), a negative index is torch's "Device index must not be negative"."""
    return torch.device(d)


def to_cuda_device(d: DeviceLike) -> torch.device:
    """A device of ``devices=`` / ``set_devices``: CUDA only (torch's ValueError)."""
    device = torch.device(d)
    if device.type != "cuda":
        raise ValueError(
            f"`set_devices` expect a list of CUDA devices, but got device type {device.type}."
        )
    return device


def check_one_to_one(device_map: Mapping[DeviceLike, DeviceLike]) -> DeviceMap:
    """One map as torch's ``_to_device_map``: two sources to one target is a ValueError."""
    full: DeviceMap = {}
    reverse: DeviceMap = {}
    for key, value in device_map.items():
        k, v = torch.device(key), torch.device(value)
        if v in reverse:
            raise ValueError(
                "`device_map` only supports 1-to-1 mapping, "
                f"trying to map {k} and {reverse[v]} to {v}"
            )
        full[k] = v
        reverse[v] = k
    return full


def _valid(devices: Iterable[torch.device], count: int) -> bool:
    return all(
        d.type == "cpu" or (d.type == "cuda" and d.index is not None and 0 <= d.index < count)
        for d in devices
    )


def _keys(d: Mapping[str, Any]) -> str:
    return f"dict_keys({list(d.keys())!r})"


def validate_device_maps(
    names: Sequence[str],
    counts: Mapping[str, int],
    maps: Mapping[str, Mapping[str, DeviceMap]],
    devices: Mapping[str, Sequence[torch.device]],
    *,
    is_static_group: bool = True,
) -> None:
    """torch's ``_validate_device_maps`` (backend_registry.py), with its ValueErrors word for
    word: every worker's ``devices`` and every worker's maps, against the device counts and
    ``devices`` of both ends. A dynamic group does not check target names (a target may join
    later)."""
    for node in names:
        own = list(devices[node])
        if len(set(own)) != len(own):
            raise ValueError(f"Node {node} has duplicated devices\ndevices = {own}")
        if not _valid(own, counts[node]):
            raise ValueError(
                f"Node {node} has devices with invalid indices\n"
                f"devices = {own}\n"
                f"device count = {counts[node]}"
            )
    for source in names:
        if is_static_group and not set(maps[source]).issubset(names):
            raise ValueError(
                f"Node {source} has invalid target node names in its device maps\n"
                f"device maps = {_keys(maps[source])}\n"
                f"node names = {list(names)}"
            )
        for target, map_ in maps[source].items():
            if len(set(map_.values())) != len(map_):
                raise ValueError(
                    f"Node {source} has duplicated target devices "
                    f"in its device map for {target}\n"
                    f"device map = {dict(map_)}"
                )
            if devices[source]:
                if not set(map_).issubset(devices[source]):
                    raise ValueError(
                        f"Node {source} has unexpected source devices "
                        f"in its device map for {target}\n"
                        f"device map = {dict(map_)}\n"
                        f"devices = {list(devices[source])}"
                    )
            elif not _valid(map_, counts[source]):
                raise ValueError(
                    f"Node {source} has source devices with invalid indices "
                    f"in its device map for {target}\n"
                    f"device map = {dict(map_)}\n"
                    f"device count = {counts[source]}"
                )
            if devices.get(target):
                if not set(map_.values()).issubset(devices[target]):
                    raise ValueError(
                        f"Node {source} has unexpected target devices "
                        f"in its device map for {target}\n"
                        f"device map = {dict(map_)}\n"
                        f"devices = {list(devices[target])}"
                    )
            elif target in counts and not _valid(map_.values(), counts[target]):
                raise ValueError(
                    f"Node {source} has target devices with invalid indices "
                    f"in its device map for {target}\n"
                    f"device map = {dict(map_)}\n"
                    f"device count = {counts[target]}"
                )


def reverse_maps(
    me: str, names: Iterable[str], maps: Mapping[str, Mapping[str, DeviceMap]]
) -> dict[str, DeviceMap]:
    """For each worker with a map to ``me``: that map inverted (what responses to it use)."""
    return {
        node: {v: k for k, v in maps[node][me].items()}
        for node in names
        if me in maps.get(node, {})
    }


def default_devices(
    devices: Sequence[torch.device],
    maps: Mapping[str, DeviceMap],
    reverse: Mapping[str, DeviceMap],
) -> list[torch.device]:
    """torch's ``_create_device_list``: the given devices, else every source device of this
    worker's maps and of its reverse maps, less the CPU; sorted by index."""
    if not devices:
        found: set[torch.device] = set()
        for map_ in maps.values():
            found.update(map_)
        for map_ in reverse.values():
            found.update(map_)
        found.discard(CPU)
        devices = list(found)
    return sorted(devices, key=lambda d: d.index if d.index is not None else -1)


def maps_to_record(
    count: int,
    maps: Mapping[str, DeviceMap],
    devices: Sequence[torch.device],
    gpus: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """What a worker publishes of its devices at init (plain JSON); ``gpus``: the UUID of
    each CUDA device it may exchange by IPC (``{"cuda:0": "GPU-..."}``), if any."""
    record: dict[str, Any] = {
        "count": count,
        "maps": {to: {str(k): str(v) for k, v in m.items()} for to, m in maps.items()},
        "devices": [str(d) for d in devices],
    }
    if gpus:
        record["gpus"] = dict(gpus)
    return record


def gpus_from_record(record: Mapping[str, Any] | None) -> dict[torch.device, str]:
    """The ``{device: GPU UUID}`` a record offers for CUDA IPC (none: an empty dict)."""
    gpus = (record or {}).get("gpus") or {}
    return {torch.device(d): str(uuid) for d, uuid in gpus.items() if uuid}


def maps_from_record(
    record: Mapping[str, Any] | None,
) -> tuple[int, dict[str, DeviceMap], list[torch.device]]:
    """The ``(device count, maps, devices)`` of a record made by :func:`maps_to_record`
    (a worker that published none -- an older distgrad -- has none)."""
    if not record:
        return 0, {}, []
    maps = {
        str(to): {torch.device(k): torch.device(v) for k, v in m.items()}
        for to, m in record.get("maps", {}).items()
    }
    return int(record.get("count", 0)), maps, [torch.device(d) for d in record.get("devices", [])]


DevicePair = tuple[torch.device, torch.device]


@dataclass
class DevicePlan:
    """One worker's device maps after init: requests to a peer use ``maps[peer]``, responses
    (and gradients, unless the message names its own map) ``reverse[peer]``; ``devices`` are
    the CUDA devices this worker's streams are synchronised on."""

    maps: dict[str, DeviceMap] = field(default_factory=dict)
    reverse: dict[str, DeviceMap] = field(default_factory=dict)
    devices: list[torch.device] = field(default_factory=list)
    #: every member's ``{device: GPU UUID}`` offered for CUDA IPC (this worker's under ``me``)
    gpus: dict[str, dict[torch.device, str]] = field(default_factory=dict)
    me: str = ""

    def ipc_pairs(self, peer: str, device_map: DeviceMap | None) -> frozenset[DevicePair]:
        """The ``(source, target)`` entries of ``device_map`` (a message to ``peer``) whose two
        ends are one physical GPU that both workers offered: those tensors go by CUDA IPC."""
        mine, theirs = self.gpus.get(self.me), self.gpus.get(peer)
        if not device_map or not mine or not theirs or peer == self.me:
            return frozenset()
        return frozenset(
            (source, target)
            for source, target in device_map.items()
            if source in mine and mine[source] == theirs.get(target)
        )

    @property
    def used(self) -> bool:
        """Whether any tensor can move off the CPU (any map, or devices)."""
        return bool(self.devices or any(self.maps.values()) or any(self.reverse.values()))

    def map_for(self, direction: str, peer: str) -> DeviceMap | None:
        """The map a message to ``peer`` uses (``direction``: "Request" or "Response"),
        ``None`` where there is none."""
        return (self.maps if direction == "Request" else self.reverse).get(peer)


def route(
    device: torch.device, device_map: DeviceMap | None, direction: str, peer: str
) -> torch.device | None:
    """Where a tensor on ``device`` lands on ``peer`` (torch's ``getDevicesForRemote`` /
    ``getDevicesForTensors``): ``None`` for a CPU tensor that stays on the CPU; a CPU tensor
    follows a ``cpu`` entry; any other tensor needs an entry for its device. Raises torch's
    RuntimeError otherwise."""
    if device_map is None:
        if device.type == "cpu":
            return None
        raise RuntimeError(
            f"{CPU_ONLY}{direction} device mapping is not available for destination {peer}, "
            f"but found tensor on device: {device}"
        )
    target = device_map.get(device)
    if device.type == "cpu":
        return target if target is not None and target.type != "cpu" else None
    if target is None:
        raise RuntimeError(
            f"{CPU_ONLY}{direction} device mapping is not available for destination {peer} "
            f"for device {device} but received a tensor on that device."
        )
    return target


def plan_devices(
    me: str,
    names: Sequence[str],
    records: Mapping[str, Mapping[str, Any] | None],
    *,
    is_static_group: bool = True,
) -> DevicePlan:
    """Validate everyone's published devices (:func:`maps_to_record`) as torch does at init
    and return ``me``'s plan: its maps, the inverse of every map to it, its devices."""
    counts: dict[str, int] = {}
    maps: dict[str, dict[str, DeviceMap]] = {}
    devices: dict[str, list[torch.device]] = {}
    for name in names:
        counts[name], maps[name], devices[name] = maps_from_record(records.get(name))
    validate_device_maps(names, counts, maps, devices, is_static_group=is_static_group)
    reverse = reverse_maps(me, names, maps)
    gpus = {name: gpus_from_record(records.get(name)) for name in names}
    return DevicePlan(
        maps[me],
        reverse,
        default_devices(devices[me], maps[me], reverse),
        {name: found for name, found in gpus.items() if found},
        me,
    )
