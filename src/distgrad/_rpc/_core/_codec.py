"""The codec stage: what may be sent to whom. Each agent has one :class:`Codec`; it turns a
payload into an :class:`~distgrad._wire._pickler.Encoded` message through the pickler, routing
tensors by the device maps (requests by this worker's map to the peer, responses by the
inverse of the peer's map to this worker; torch's errors for a tensor no map covers) and
refusing messages over the sender's or the receiver's size limit -- before anything is
written."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from ..._config import CUDA_IPC_THRESHOLD
from ..._devices._backend import DeviceBackend
from ..._devices._maps import CPU, DeviceMap, DevicePlan, route
from ..._errors import MessageTooLargeError
from ..._transport._base import PeerAddress
from ..._wire._pickler import Encoded
from ._options import TensorPipeRpcBackendOptions
from ._worker_info import WorkerInfo

__all__ = ["UDF_MISSING", "Codec", "DeviceRouter"]

UDF_MISSING = (
    "Default RPC pickler does not serialize function code. Ensure that UDFs are defined on "
    "both caller and callee modules."
)


class Codec:
    """Per-agent checks on outgoing messages: device checks (cached per direction and peer)
    and the size limit (this worker's, or a peer's lower one that came with its address)."""

    def __init__(
        self,
        options: TensorPipeRpcBackendOptions,
        by_rank: Mapping[int, WorkerInfo],
        label: Callable[[int], str],
    ) -> None:
        self.options = options
        self._by_rank = by_rank
        self._label = label
        #: this worker's device maps after init (none until then: CPU tensors only)
        self.plan = DevicePlan()
        #: what moves and orders tensors on devices (the CPU no-op unless the plan names CUDA)
        self.backend = DeviceBackend()
        self._device_checks: dict[tuple[str, int], DeviceRouter] = {}
        self._peer_limits: dict[int, int] = {}  # peers accepting less than this worker
        #: the lowest limit of all (this worker's and its peers'): a message of at most this
        #: many bytes passes :meth:`check_bytes` for every peer, which need not be asked
        self.least_limit = options.max_message_size

    @property
    def max_message_size(self) -> int:
        """This worker's limit (``TensorPipeRpcBackendOptions.max_message_size``)."""
        return self.options.max_message_size

    def __repr__(self) -> str:
        return f"Codec(max_message_size={self.max_message_size}, peer_limits={self._peer_limits})"

    def set_peer_limits(self, addresses: Mapping[int, PeerAddress]) -> None:
        """Remember the peers that accept less than this worker does."""
        self._peer_limits = {
            rank: address.max_message_size
            for rank, address in addresses.items()
            if 0 < address.max_message_size < self.max_message_size
        }
        self.least_limit = min([self.max_message_size, *self._peer_limits.values()])

    def set_peer_limit(self, rank: int, max_message_size: int) -> None:
        """Remember what one (new) peer accepts."""
        if 0 < max_message_size < self.max_message_size:
            self._peer_limits[rank] = max_message_size
        else:
            self._peer_limits.pop(rank, None)
        self.least_limit = min([self.max_message_size, *self._peer_limits.values()])

    def set_device_plan(self, plan: DevicePlan, backend: DeviceBackend) -> None:
        """Use ``plan``'s maps from now on (init, or a member joined), moved by ``backend``."""
        self.plan = plan
        self.backend = backend
        self._device_checks.clear()

    def device_check(
        self, direction: str, rank: int, device_map: DeviceMap | None = None
    ) -> DeviceRouter:
        """What the pickler calls for the tensors of a message to ``rank``: ``direction`` is
        ``"Request"`` (this worker's map to the peer) or ``"Response"`` (the inverse of the
        peer's map to this worker), unless the message brings its own ``device_map`` (a
        gradient message: the inverse of the map its forward call came with)."""
        if device_map is not None:
            return self._router(direction, rank, device_map)
        key = (direction, rank)
        check = self._device_checks.get(key)
        if check is None:
            check = self._device_checks[key] = self._router(direction, rank, None)
        return check

    def _router(self, direction: str, rank: int, device_map: DeviceMap | None) -> DeviceRouter:
        info = self._by_rank.get(rank)
        name = info.name if info is not None else str(rank)
        if device_map is None:
            device_map = self.plan.map_for(direction, name)
        return DeviceRouter(direction, name, device_map, self.plan, self.backend)

    def check_size(self, encoded: Encoded, dst: int) -> int:
        """Refuse to send what this worker, or the peer (whose limit came with its address),
        would refuse to receive: the peer would drop the connection, and the call would fail
        without saying why, and every call on that connection with it. Returns the size."""
        size = len(encoded.meta)
        for buffer in encoded.buffers:  # (a loop: a generator costs more for one or two)
            size += buffer.raw().nbytes
        if size > self.least_limit:
            self.check_bytes(size, dst)
        return size

    def check_bytes(self, size: int, dst: int) -> None:
        """:meth:`check_size` of a message of ``size`` bytes (a caller that knows the size
        asks only when it is above :attr:`least_limit`)."""
        limit = self.options.max_message_size
        peer_limit = self._peer_limits.get(dst)
        if peer_limit is not None:
            limit = peer_limit
        if size > limit:
            whose = "" if peer_limit is None else f" of {self._label(dst)}"
            raise MessageTooLargeError(
                f"message of {size} bytes exceeds the maximum message size{whose} of {limit} "
                "bytes (TensorPipeRpcBackendOptions(max_message_size=...))"
            )


class DeviceRouter:
    """Routes each tensor of one message by one device map (``_maps.route``), staging those
    that land on a device through the backend; a true ``routes_cpu`` asks the pickler to
    route CPU tensors too (the map has a ``cpu`` entry)."""

    __slots__ = ("backend", "devices", "direction", "ipc", "map", "peer", "routes_cpu")

    def __init__(
        self,
        direction: str,
        peer: str,
        device_map: DeviceMap | None,
        plan: DevicePlan,
        backend: DeviceBackend,
    ) -> None:
        self.direction = direction
        self.peer = peer
        self.map = device_map
        self.devices = plan.devices
        self.backend = backend
        target = device_map.get(CPU) if device_map else None
        self.routes_cpu = target is not None and target.type != "cpu"
        #: (source, target) entries between one GPU both workers share: by CUDA IPC
        self.ipc = plan.ipc_pairs(peer, device_map)

    def __repr__(self) -> str:
        return f"DeviceRouter({self.direction} to {self.peer}, map={self.map})"

    def __call__(self, tensor: torch.Tensor) -> object:
        device = tensor.device
        target = route(device, self.map, self.direction, self.peer)
        if target is None:
            return None
        if self.direction == "Response" and device.type != "cpu" and device not in self.devices:
            devices = ", ".join(str(d) for d in self.devices)
            raise RuntimeError(
                f"RPC detected that a user-function output tensor on device {device}. This "
                f"device is not one of the input tensor devices: {devices}, which is not yet "
                "supported. Please file a feature request issue in PyTorch GitHub repo."
            )
        if (
            self.ipc
            and (device, target) in self.ipc
            and tensor.numel() * tensor.element_size() >= CUDA_IPC_THRESHOLD
        ):
            return self.backend.stage_shared(tensor, target)
        return self.backend.stage(tensor, target)
