"""The CUDA implementation of the device interface: staging through pinned host memory, with
streams ordered as torch's TensorPipe agent orders them (CUDA.md section 2).

* **Send** (:meth:`CudaBackend.stage`): a stream from torch's pool waits on the sender's
  current stream of the tensor's device, copies the tensor into pinned host memory, and the
  sending thread waits for that one stream's copy (its bytes must be final before they
  leave): never a device-wide synchronize.
* **Receive** (:meth:`CudaBackend.arrive`): per message and device, one fresh pool stream
  (which first waits on the receiving thread's current stream) copies the bytes to the
  device; the message's :class:`~._backend.Arrivals` name those streams.
* **Callee**: the user function runs, and its reply is staged, under the arrival streams
  (torch's ``MultiStreamGuard``), so its work is ordered after the copies.
* **Caller**: ``rpc_sync``'s thread makes its current streams wait on the arrival streams
  and records the tensors on them; ``rpc_async``'s future is torch's device-aware future,
  completed under the arrival streams: its ``wait()`` makes the waiter's current streams wait
  (events, no host wait), and ``then()`` callbacks run on streams synchronised with them.

Chosen only when the worker's device plan names CUDA devices; unverified here without a GPU
except where ``tests/gpu`` says it passed (docs/cuda.md).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from ._backend import Arrivals, DeviceBackend, _arrive, _note, state

__all__ = ["CudaBackend"]


class CudaBackend(DeviceBackend):
    """Device tensors over RPC by staging through pinned host memory, streams as torch's."""

    name = "cuda"

    def stage(self, tensor: torch.Tensor, target: torch.device) -> Any:
        requires_grad = tensor.requires_grad
        source = tensor.detach()
        if source.layout != torch.strided:  # sparse: its indices and values, to the host
            host = source.cpu()
        elif source.device.type == "cuda":
            device = source.device
            stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]  # torch's pool
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                if not source.is_contiguous():
                    source = source.contiguous()
                host = torch.empty(source.shape, dtype=source.dtype, pin_memory=True)
                host.copy_(source, non_blocking=True)
            stream.synchronize()  # this stream only: the bytes are final before they leave
        elif source.device.type == "cpu":
            host = source
        else:
            host = source.cpu()
        return (_arrive, (host, str(target), requires_grad))

    def arrive(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        if device.type != "cuda":
            return super().arrive(host, device)
        arrivals = state.arrivals
        stream = arrivals.streams.get(device) if arrivals is not None else None
        if stream is None:
            # a fresh pool stream, as torch's receive: it waits on nothing (the thread's
            # current stream may be a training loop's backlog: a pageable copy queued behind
            # it would hold this thread until the GPU drained it)
            stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        with torch.cuda.stream(stream):
            if host.layout != torch.strided:  # sparse: indices and values go over
                out = host.to(device, non_blocking=True)
            else:
                out = torch.empty(host.shape, dtype=host.dtype, device=device)
                # pageable source: the driver has staged it when this returns, so the received
                # buffer may be freed at once; a pinned one would let the copy overlap the receive
                out.copy_(host, non_blocking=True)
        _note(device, stream, out)
        return out

    @contextlib.contextmanager
    def running_under(self, arrivals: Arrivals | None) -> Iterator[None]:
        if arrivals is None:
            yield
            return
        with contextlib.ExitStack() as stack:
            for stream in arrivals.streams.values():
                if stream is not None:
                    stack.enter_context(torch.cuda.stream(stream))
            yield

    def join_current(self, arrivals: Arrivals | None) -> None:
        if arrivals is None:
            return
        currents: dict[torch.device, Any] = {}
        for device, stream in arrivals.streams.items():
            if stream is not None:
                current = currents[device] = torch.cuda.current_stream(device)
                current.wait_stream(stream)
        for tensor in arrivals.tensors:
            waiting = currents.get(tensor.device)
            if waiting is not None:
                tensor.record_stream(waiting)  # the allocator must not reuse it early

    def settle(self, arrivals: Arrivals | None) -> None:
        if arrivals is None:
            return
        for stream in arrivals.streams.values():
            if stream is not None:
                stream.synchronize()

    def new_future(self, kind: type[Any], devices: list[torch.device]) -> Any:
        cuda = [d for d in devices if d.type == "cuda"]
        if not cuda:
            return kind()
        future = kind(devices=cuda)
        future._device_list = cuda  # (RpcFuture: ``then`` passes the devices on)
        return future
