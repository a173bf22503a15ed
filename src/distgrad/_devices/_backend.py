"""The one interface behind which tensors on devices move and are ordered.

A message's tensors are routed by the device maps (``_maps.route``); a tensor that lands on a
device travels as its bytes on the host plus its target device: the sender's backend
:meth:`~DeviceBackend.stage`\\ s it (for CUDA: a copy to pinned host memory, ordered after the
sender's current stream), and the pickle stream rebuilds it with :func:`_arrive`, which hands
the bytes to the receiving process's backend (:meth:`~DeviceBackend.arrive`: for CUDA, a copy
to the device on a fresh stream). What one decode received is an :class:`Arrivals` (thread-
local, taken by the code that decoded) that orders the rest: the callee runs under it
(:meth:`~DeviceBackend.running_under`), a caller's current streams wait for it
(:meth:`~DeviceBackend.join_current`), a future completed under it records its events.

:class:`DeviceBackend` itself is the CPU implementation: every ordering is a no-op, staging
sends a CPU tensor as it is (a CPU tensor that follows a ``cpu -> cuda:N`` entry), and
:meth:`~DeviceBackend.arrive` is a plain ``.to(device)``. A process whose maps name no CUDA
device never leaves it, and nothing on the CPU path calls into this module except one
module-attribute read per decoded message (``Process.seen``).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = [
    "Arrivals",
    "DeviceBackend",
    "Process",
    "install_receiver",
    "receiver",
    "state",
    "take_arrivals",
]


@dataclass
class Arrivals:
    """What one decoded message put on devices: the stream (or ``None`` where the backend
    has no streams) that carried each device's copies, and the tensors."""

    streams: dict[torch.device, Any] = field(default_factory=dict)
    tensors: list[torch.Tensor] = field(default_factory=list)


class _State(threading.local):
    arrivals: Arrivals | None = None


#: ``state.arrivals``: what the decode in progress on this thread received on devices
state = _State()


class Process:
    """Process-wide device state."""

    #: whether any tensor ever arrived on a device in this process (the CPU path's one check)
    seen = False
    backend: DeviceBackend | None = None


def any_arrived() -> bool:
    """Whether a tensor ever arrived on a device in this process."""
    return Process.seen


def take_arrivals() -> Arrivals | None:
    """What the decode just finished on this thread received on devices (and forget it)."""
    arrivals = state.arrivals
    if arrivals is not None:
        state.arrivals = None
    return arrivals


class DeviceBackend:
    """The CPU implementation of the device interface (see the module's docstring); the CUDA
    one (``_cuda.CudaBackend``) overrides every method."""

    name = "cpu"

    def device_count(self) -> int:
        """How many CUDA devices this worker has (published at init for the validation)."""
        return torch.cuda.device_count()

    def gpu_ids(self, devices: list[torch.device]) -> dict[str, str]:
        """The UUID of each of ``devices`` (CUDA devices this worker may exchange by CUDA IPC
        with a worker on the same GPU); none where CUDA is not available."""
        if not devices or not torch.cuda.is_available():
            return {}
        found = {}
        for device in devices:
            if device.index is None or device.index >= torch.cuda.device_count():
                continue
            uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
            if uuid is not None:
                found[str(device)] = str(uuid)
        return found

    def stage_shared(self, tensor: torch.Tensor, target: torch.device) -> Any:
        """:meth:`stage` for a peer that has ``tensor``'s GPU as ``target`` (same host, same
        physical device): the CUDA backend shares a copy of it by CUDA IPC instead of staging
        it through host memory."""
        return self.stage(tensor, target)

    def arrive_shared(self, rebuild: Any, args: tuple[Any, ...], device: torch.device) -> Any:
        """A tensor shared by :meth:`stage_shared`: a copy on ``device`` (noted in
        :data:`state`)."""
        raise RuntimeError("received a CUDA tensor by IPC on a worker without CUDA")

    def stage(self, tensor: torch.Tensor, target: torch.device) -> Any:
        """The reduction that sends ``tensor`` to land on ``target``: its bytes on the host
        (final when this returns: nothing later may change what is sent) and the target."""
        requires_grad = tensor.requires_grad
        host = tensor.detach()
        if host.device.type != "cpu":
            host = host.cpu()
        return (_arrive, (host, str(target), requires_grad))

    def arrive(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        """A received host tensor, put on ``device`` (noted in :data:`state`)."""
        out = host.to(device)
        _note(device, None, out)
        return out

    @contextlib.contextmanager
    def running_under(self, arrivals: Arrivals | None) -> Iterator[None]:
        """Run the callee's function (and encode its reply) ordered after ``arrivals``."""
        yield

    def join_current(self, arrivals: Arrivals | None) -> None:
        """Make this thread's current streams wait for ``arrivals`` (no host wait)."""

    def settle(self, arrivals: Arrivals | None) -> None:
        """Wait on the host until ``arrivals`` are complete (for values handed to threads
        whose streams are not known)."""

    def new_future(self, kind: type[Any], devices: list[torch.device]) -> Any:
        """A future of ``kind`` (a ``torch.futures.Future`` class) for results that may hold
        tensors on ``devices`` (CUDA: torch's device-aware future)."""
        return kind()


def _note(device: torch.device, stream: Any, tensor: torch.Tensor) -> None:
    arrivals = state.arrivals
    if arrivals is None:
        arrivals = state.arrivals = Arrivals()
    if device not in arrivals.streams:
        arrivals.streams[device] = stream
    arrivals.tensors.append(tensor)


def install_receiver(backend: DeviceBackend) -> None:
    """Make ``backend`` the one that receives device tensors in this process (an agent whose
    plan uses devices installs its backend when it starts)."""
    Process.backend = backend


def receiver() -> DeviceBackend:
    """This process's receiving backend (the CPU one until an agent installs another)."""
    backend = Process.backend
    if backend is None:
        backend = Process.backend = DeviceBackend()
    return backend


def _arrive(host: torch.Tensor, device: str, requires_grad: bool) -> torch.Tensor:
    """Unpickling side of a staged tensor: put its bytes on ``device`` (this process's
    backend), as a leaf that requires grad if the sent tensor did."""
    if device == "cpu":  # a device tensor mapped to this worker's CPU: the bytes are it
        return host.requires_grad_() if requires_grad else host
    Process.seen = True
    out = receiver().arrive(host, torch.device(device))
    if requires_grad:
        out.requires_grad_()
    return out


def _arrive_shared(
    rebuild: Any, args: tuple[Any, ...], device: str, requires_grad: bool
) -> torch.Tensor:
    """Unpickling side of a tensor shared by CUDA IPC: a copy of it on ``device`` (this
    process's backend), as a leaf that requires grad if the sent tensor did."""
    Process.seen = True
    out: torch.Tensor = receiver().arrive_shared(rebuild, args, torch.device(device))
    if requires_grad:
        out.requires_grad_()
    return out
