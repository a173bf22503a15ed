"""The CUDA implementation of the device interface, streams ordered as torch's TensorPipe
agent orders them (CUDA.md section 2).

* **Send, by CUDA IPC** (:meth:`CudaBackend.stage_shared`, tensors from
  ``CUDA_IPC_THRESHOLD`` bytes to a worker on the same physical GPU): a pool stream waits on
  the sender's current stream and copies the tensor on the device; torch's IPC reduction
  describes the copy (IPC handle, reference count, interprocess event); the sender's current
  stream waits for the copy. No host memory, no host wait.
* **Send, staged** (:meth:`CudaBackend.stage`, everything else): a pool stream waits on the
  sender's current stream and copies the tensor into pinned host memory, and the sending
  thread waits for that one stream (its bytes must be final before they leave): never a
  device-wide synchronize.
* **Receive** (:meth:`CudaBackend.arrive`, :meth:`CudaBackend.arrive_shared`): per message and
  device, one fresh pool stream (waiting on nothing, as torch's) copies the bytes (or the
  shared tensor, after the sender's event) to the device; the message's
  :class:`~._backend.Arrivals` name those streams.
* **Callee**: the user function runs, and its reply is staged, under the arrival streams
  (torch's ``MultiStreamGuard``), so its work is ordered after the copies.
* **Caller**: ``rpc_sync``'s thread makes its current streams wait on the arrival streams
  and records the tensors on them; ``rpc_async``'s future is torch's device-aware future,
  completed under the arrival streams: its ``wait()`` makes the waiter's current streams wait
  (events, no host wait), and ``then()`` callbacks run on streams synchronised with them.

Chosen only when the worker's device plan names CUDA devices; run on a GPU by
``scripts/gpu_check.sh`` (docs/cuda.md says where and what passed).
"""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch.multiprocessing.reductions import reduce_tensor

from ._backend import Arrivals, DeviceBackend, _arrive, _arrive_shared, _note, state

__all__ = ["CudaBackend"]

#: tensors this process sent and received by CUDA IPC (tests read them)
COUNTS = {"shared_sent": 0, "shared_received": 0}
#: copies sent by IPC are freed in batches (``ipc_collect``: each call with nothing left to
#: free also drops torch's reference-count file, which the next send must make again); the
#: CUDA allocator also collects them when it runs short of memory
_COLLECT_EVERY = 32
#: where the sender's CUDA IPC description puts the device index and ``requires_grad``
_IPC_DEVICE, _IPC_REQUIRES_GRAD = 6, 10


class CudaBackend(DeviceBackend):
    """Device tensors over RPC: by CUDA IPC between workers on one GPU, else staged through
    pinned host memory; streams as torch's."""

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

    def stage_shared(self, tensor: torch.Tensor, target: torch.device) -> Any:
        """Share a copy of ``tensor`` by CUDA IPC with a worker whose ``target`` is the same
        GPU: a pool stream waits on the sender's current stream and copies the tensor on the
        device (its bytes are the copy's from then on: the caller may change the tensor), and
        torch's ``reduce_tensor`` describes the copy (its allocation's IPC handle, cached by
        the driver, and an interprocess event recorded after the copy). No host wait; torch's
        reference counting keeps the copy's memory until the receiver lets it go."""
        source = tensor.detach()
        if source.layout != torch.strided or source.device.type != "cuda":
            return self.stage(tensor, target)
        device = source.device
        COUNTS["shared_sent"] += 1
        if COUNTS["shared_sent"] % _COLLECT_EVERY == 0:  # free copies the receivers let go of
            torch.cuda.ipc_collect()  # type: ignore[no-untyped-call]
        _RELEASES.release_finished()
        stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]  # torch's pool
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            copy = torch.empty(source.shape, dtype=source.dtype, device=device)
            copy.copy_(source, non_blocking=True)
            try:
                rebuild, args = reduce_tensor(copy)  # type: ignore[no-untyped-call]  # + IPC event
            except RuntimeError:  # e.g. expandable segments without pidfd_getfd: stage it
                return self.stage(tensor, target)
        # work queued after this call (the caller changing or freeing the tensor) waits for
        # the copy: on the GPU, with no host wait
        torch.cuda.current_stream(device).wait_stream(stream)
        args = list(args)
        args[_IPC_DEVICE] = target.index  # the same GPU, in the receiver's numbering
        args[_IPC_REQUIRES_GRAD] = False
        return (_arrive_shared, (rebuild, tuple(args), str(target), tensor.requires_grad))

    def arrive_shared(self, rebuild: Any, args: tuple[Any, ...], device: torch.device) -> Any:
        """The receiving side of :meth:`stage_shared`: on the message's arrival stream (which
        waits on the sender's event), copy the shared tensor into memory of this process; the
        shared one is let go once that copy has run (:class:`_Releases`), never with a host
        wait here."""
        arrivals = state.arrivals
        stream = arrivals.streams.get(device) if arrivals is not None else None
        if stream is None:
            stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        with torch.cuda.stream(stream):
            shared = rebuild(*args)  # this stream waits on the sender's copy (IPC event)
            out = torch.empty(shared.shape, dtype=shared.dtype, device=device)
            out.copy_(shared, non_blocking=True)
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            done.record(stream)
        _RELEASES.hold(done, shared, device)
        COUNTS["shared_received"] += 1
        _note(device, stream, out)
        return out

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
            device = torch.cuda.current_device()
            for stream in arrivals.streams.values():
                if stream is not None:
                    stack.enter_context(torch.cuda.stream(stream))
            # torch.cuda.stream() also makes its stream's device the current one; torch's
            # MultiStreamGuard does not: the callee runs on the device it would have
            stack.enter_context(torch.cuda.device(device))
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
            if waiting is not None:  # the allocator must not reuse it early
                if tensor.layout == torch.sparse_coo:  # (record_stream has no sparse kernel)
                    tensor._indices().record_stream(waiting)
                    tensor._values().record_stream(waiting)
                elif tensor.layout == torch.strided:
                    tensor.record_stream(waiting)
        _RELEASES.release_finished()

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


class _Releases:
    """Tensors received by CUDA IPC, held until the copy out of them has run on the GPU.

    Dropping the last reference to a storage opened by IPC makes torch synchronise the
    current stream of its device and then tell the sender's reference count: dropped on the
    decoding thread, that would be a host wait for the copy (and for anything queued before
    it on that stream). Held here instead, each is dropped at a later arrival or send, once its
    copy's event has completed, under a stream of its own that has nothing queued."""

    def __init__(self) -> None:
        self._held: collections.deque[tuple[Any, torch.Tensor, torch.device]] = collections.deque()
        self._lock = threading.Lock()
        self._quiet: dict[torch.device, Any] = {}

    def hold(self, done: Any, shared: torch.Tensor, device: torch.device) -> None:
        with self._lock:
            self._held.append((done, shared, device))
        self.release_finished()

    def release_finished(self) -> None:
        """Let go of every held tensor whose copy has run."""
        ready = []
        with self._lock:
            while self._held and self._held[0][0].query():
                ready.append(self._held.popleft())
        while ready:
            _done, shared, device = ready.pop()
            quiet = self._quiet.get(device)
            if quiet is None:
                quiet = torch.cuda.Stream(device, priority=-1)  # type: ignore[no-untyped-call]
                self._quiet[device] = quiet
            with torch.cuda.stream(quiet):
                del shared  # the last reference: its deleter synchronises ``quiet`` (idle)

    def __len__(self) -> int:
        return len(self._held)


_RELEASES = _Releases()
