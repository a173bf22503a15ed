"""The codec stage: what may be sent to whom. Each agent has one :class:`Codec`; it turns a
payload into an :class:`~distgrad._wire._pickler.Encoded` message through the pickler, refusing
tensors not on the CPU (the reference's error) and messages over the sender's or the
receiver's size limit -- before anything is written."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from ..._errors import MessageTooLargeError
from ..._transport._base import PeerAddress
from ..._wire._pickler import Encoded
from ._options import TensorPipeRpcBackendOptions
from ._worker_info import WorkerInfo

__all__ = ["UDF_MISSING", "Codec", "DeviceCheck"]

DeviceCheck = Callable[[torch.Tensor], torch.Tensor]

_CPU_ONLY = (
    "TensorPipe RPC backend only supports CPU tensors by default, please move your tensors to "
    "CPU before sending them over RPC, or call `set_device_map` on "
    "`TensorPipeRpcBackendOptions` to explicitly configure device mapping. "
)
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
        self._device_checks: dict[tuple[str, int], DeviceCheck] = {}
        self._peer_limits: dict[int, int] = {}  # peers accepting less than this worker

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

    def set_peer_limit(self, rank: int, max_message_size: int) -> None:
        """Remember what one (new) peer accepts."""
        if 0 < max_message_size < self.max_message_size:
            self._peer_limits[rank] = max_message_size
        else:
            self._peer_limits.pop(rank, None)

    def device_check(self, direction: str, rank: int) -> DeviceCheck:
        """What the pickler calls for a tensor that is not on the CPU: distgrad moves only CPU
        tensors (device maps are accepted, not applied yet), so it raises the reference's error
        for a destination without a device map -- instead of letting torch's own pickling copy
        the tensor through the CPU and rebuild it on whatever device the receiver has."""
        key = (direction, rank)
        check = self._device_checks.get(key)
        if check is None:
            info = self._by_rank.get(rank)
            name = info.name if info is not None else str(rank)
            mapped = name in self.options.device_maps

            def refuse(tensor: torch.Tensor) -> torch.Tensor:
                if mapped:
                    raise RuntimeError(
                        f"distgrad does not move {tensor.device} tensors over RPC yet: device "
                        f"maps are accepted but not applied (destination {name}); move the "
                        "tensor to the CPU before sending it"
                    )
                raise RuntimeError(
                    f"{_CPU_ONLY}{direction} device mapping is not available for destination "
                    f"{name}, but found tensor on device: {tensor.device}"
                )

            check = self._device_checks[key] = refuse
        return check

    def check_size(self, encoded: Encoded, dst: int) -> int:
        """Refuse to send what this worker, or the peer (whose limit came with its address),
        would refuse to receive: the peer would drop the connection, and the call would fail
        without saying why, and every call on that connection with it. Returns the size."""
        limit = self.options.max_message_size
        peer_limit = self._peer_limits.get(dst)
        if peer_limit is not None:
            limit = peer_limit
        size = len(encoded.meta)
        if encoded.buffers:
            size += sum(buffer.raw().nbytes for buffer in encoded.buffers)
        if size > limit:
            whose = "" if peer_limit is None else f" of {self._label(dst)}"
            raise MessageTooLargeError(
                f"message of {size} bytes exceeds the maximum message size{whose} of {limit} "
                "bytes (TensorPipeRpcBackendOptions(max_message_size=...))"
            )
        return size
