"""The RPC agent: a coordinator of small stages, one module each.

* ``_codec``: what may be sent to whom (device checks, size limits);
* ``_outgoing``: a call is encoded, registered in the calls table (``_call_table``, which
  also holds the timeout wheel) and sent; its answer, timeout, peer failure or the agent
  stopping completes or fails it;
* ``_oneway``: one-way messages (``notify``, ``post``) and retried internal requests; a send
  that would have to dial where nothing may wait (the I/O thread, a context's cleanup) goes
  to the dialing threads (``_dialer``);
* ``_serving``: a request is decoded, waits for the confirmations of the RRefs it carries,
  runs and is answered; notifications run their handlers;
* ``_current``: which agent a thread belongs to (the storage; the typed accessors
  :func:`current_agent`, :func:`require_agent`, :func:`bind_thread` and
  :func:`set_current_agent` are here).

This module starts and stops them, knows the workers, and routes what the transport
delivers (:meth:`RpcAgent.on_frame`, :meth:`RpcAgent.on_connection_lost`).

Threads, and what runs where:

* the **caller's thread** pickles a request and writes it straight to the socket (no hop);
  ``rpc_sync`` then reads its connection itself until its answer is there (it holds the
  connection's read role: ``Connection.read_until``; the I/O thread is not woken) and
  unpickles the response -- or, when another thread reads that connection, sleeps on a lock
  until the answer is handed over;
* the **I/O thread** reads frames where no one else does; a response is matched to its call
  and handed back to the waiting caller (or, for ``rpc_async``, to the callback pool); a
  request goes to the worker pool; it also fires timeouts and heartbeats;
* the **worker pool** (``num_worker_threads``, elastic) unpickles requests, runs user
  functions and writes their responses; a worker that served a request lingers a moment on
  its connection for the peer's next request and runs it itself
  (``Connection.serve_lingering``); nested RPCs from a user function just block that one
  worker thread;
* the **callback pool** completes ``rpc_async`` futures, so user callbacks (``then``,
  ``add_done_callback``) never run on the I/O thread and may themselves make RPCs.

Layers above also have a lean internal path with no future and no thread hop:
:meth:`RpcAgent.call_internal` hands the answer to a callback where it arrives (the I/O
thread), and :meth:`RpcAgent.notify` sends a one-way message (a ``NOTIFY`` frame, never
answered) whose handler runs on the receiver's I/O thread if it is marked ``on_io_thread``, on
a worker thread otherwise. The distributed backward engine uses both for its gradient messages.

A request carries ``(func, args, kwargs)`` and a response the result; tensors travel in the
message's tensor table, together with an ``ext`` object that belongs to the layer above (see
``_layer``: distributed autograd, the layer that records calls, attaches its metadata there).
The layers above hear of the agent's start, of lost peers and of a graceful shutdown through
the same protocol.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import torch

from ... import _config
from ..._devices._backend import DeviceBackend, install_receiver
from ..._devices._cuda import CudaBackend
from ..._devices._maps import (
    DeviceMap,
    DevicePlan,
    default_devices,
    gpus_from_record,
    maps_from_record,
    maps_to_record,
)
from ..._errors import PeerFailureError, RpcShutdownError
from ..._omp import join_openmp_runtime
from ..._transport._base import (
    Link,
    PeerAddress,
    Transport,
    TransportConfig,
    TransportFactory,
    TransportStatistics,
)
from ..._transport._io import IoThread
from ..._wire._frames import Frame, Kind
from . import _current, _layer, _pool
from ._call_table import CallTable
from ._codec import Codec
from ._current import thread_binding
from ._dialer import Dialer
from ._events import MembershipEvent, MembershipKind
from ._lane import SerialLane
from ._oneway import RETRY_ATTEMPTS, OneWay
from ._options import TensorPipeRpcBackendOptions
from ._outgoing import AnswerCallback, Outgoing
from ._pool import ThreadPool
from ._serving import Serving
from ._shared import Shared
from ._statistics import AgentState, AgentStatistics, StatisticsRecorder
from ._wire_choices import WireChoices
from ._worker_info import WorkerInfo

_log = logging.getLogger("distgrad.rpc")

__all__ = [
    "RpcAgent",
    "bind_thread",
    "current_agent",
    "require_agent",
    "set_current_agent",
    "thread_binding",
]


def current_agent() -> RpcAgent | None:
    """The agent of the calling thread: the one it is bound to (in-memory worlds), else the
    process's (``init_rpc``)."""
    agent: RpcAgent | None = thread_binding.agent
    if agent is None:
        agent = _current.process
    return agent


def require_agent() -> RpcAgent:
    """The calling thread's agent, or torch's error when RPC is not initialized."""
    agent: RpcAgent | None = thread_binding.agent  # (current_agent, inline: on every call)
    if agent is None:
        agent = _current.process
    if agent is None:
        raise RuntimeError(
            "RPC has not been initialized. Call torch.distributed.rpc.init_rpc first."
        )
    return agent


def bind_thread(agent: RpcAgent | None) -> RpcAgent | None:
    """Make ``agent`` the calling thread's agent (``None``: unbind); returns the previous one."""
    previous: RpcAgent | None = thread_binding.agent
    thread_binding.agent = agent
    return previous


def set_current_agent(agent: RpcAgent | None) -> None:
    """Make ``agent`` the process's agent (``init_rpc``; ``None`` at shutdown)."""
    _current.process = agent


class RpcAgent:
    """One worker's agent. Created and started by ``init_rpc``; stopped by ``shutdown``.

    ``transport`` builds the transport that moves its frames (sockets for ``init_rpc``; see
    ``distgrad._transport._base`` for the contract). An ``isolated`` agent shares its process
    with other agents (an in-memory test world): every thread it owns is bound to it
    (:func:`bind_thread`), and the layers above keep their per-worker state for it apart."""

    def __init__(
        self,
        name: str,
        rank: int,
        world_size: int,
        options: TensorPipeRpcBackendOptions,
        *,
        transport: TransportFactory,
        isolated: bool = False,
        dynamic: bool = False,
    ) -> None:
        #: the pickler and allow-list its options chose (for the process; undone at stop)
        self.wire_choices = WireChoices(options)  # (first: a bad choice fails before anything)
        self.worker_info = WorkerInfo(name, rank)
        self.pid = os.getpid()  # the process whose threads these are (not a forked child)
        self.world_size = world_size
        #: members join and leave (``init_rpc(world_size=None)``)
        self.dynamic = dynamic
        #: the random id of this start of the agent (presented in every handshake)
        self.incarnation = int.from_bytes(os.urandom(8), "little") or 1
        self._incarnation_of: dict[int, int] = {rank: self.incarnation}
        #: incarnations removed from the group (rank, incarnation): never members again
        self._gone: set[tuple[int, int]] = set()
        #: members that left the group (by name), for errors that name them as departed
        self.departed: dict[str, WorkerInfo] = {}
        #: called (on a callback thread) with every :class:`MembershipEvent`
        self.membership_listeners: list[Callable[[MembershipEvent], None]] = []
        self.options = options
        self.isolated = isolated
        bind = self._bind_thread if isolated else None
        #: per-worker state of the layers above (keyed by the layer's key): RRefs keep their
        #: tables here; autograd its contexts, for isolated agents
        self.layer_state: dict[object, object] = {}
        #: the cluster secret, once the transport started (the metrics endpoint's guard)
        self.secret: bytes | None = None
        #: what the stages share: the state, the transport once started, the default timeout
        self._shared = Shared(self.worker_info, options.rpc_timeout)
        self._io = IoThread(on_start=bind)
        self._transport_factory = transport
        self.address: PeerAddress | None = None
        self._by_name: dict[str, WorkerInfo] = {name: self.worker_info}
        self._by_rank: dict[int, WorkerInfo] = {rank: self.worker_info}
        self._workers = ThreadPool("distgrad-worker", options.num_worker_threads, on_start=bind)
        self._callbacks = ThreadPool("distgrad-callback", options.num_worker_threads, on_start=bind)
        self._pools = (self._workers, self._callbacks)
        # one-way messages with device tensors are decoded here, off the I/O thread (_serving)
        self._device_lane = SerialLane("distgrad-device-lane", on_start=bind)
        self._dialer = Dialer(on_start=bind)
        self._stats = StatisticsRecorder()
        self.keepalive: list[Any] = []  # objects that must live as long as the agent (store)
        self._codec = Codec(options, self._by_rank, self._label)
        # the stages (each made here, and given what it uses)
        self._outgoing = Outgoing(
            self._shared,
            codec=self._codec,
            io=self._io,
            callbacks=self._callbacks,
            pools=self._pools,
            stats=self._stats,
            lookup=self.get_worker_info,
        )
        self._oneway = OneWay(
            self._shared,
            codec=self._codec,
            io=self._io,
            dialer=self._dialer,
            callbacks=self._callbacks,
            outgoing=self._outgoing,
            lookup=self.get_worker_info,
            incarnation_of=self.incarnation_of,
        )
        self._serving = Serving(
            self._shared,
            agent=self,
            codec=self._codec,
            workers=self._workers,
            lane=self._device_lane,
            stats=self._stats,
            blocking=self.blocking,
        )

    def _bind_thread(self) -> None:
        bind_thread(self)

    # -- devices ---------------------------------------------------------------------------------
    def _chosen_backend(self) -> DeviceBackend | None:
        """A backend given in the options (``_device_backend``: tests' fakes), if any."""
        backend: DeviceBackend | None = getattr(self.options, "_device_backend", None)
        return backend

    def device_record(self) -> dict[str, Any]:
        """What this worker publishes of its devices at init: its CUDA device count, maps
        and ``devices`` (validated by every worker as torch does)."""
        backend = self._chosen_backend() or DeviceBackend()
        opts = self.options
        gpus = None
        count = backend.device_count()
        if _config.env_flag(_config.ENV_CUDA_IPC, True) and (opts.devices or opts.device_maps):
            # every GPU it sees, offered for CUDA IPC with peers that see the same one (a
            # worker that maps devices initialises CUDA at init anyway)
            gpus = backend.gpu_ids([torch.device("cuda", i) for i in range(count)])
        return maps_to_record(count, opts.device_maps, opts.devices, gpus)

    @property
    def device_plan(self) -> DevicePlan:
        """This worker's device maps after init (requests, responses, devices)."""
        return self._codec.plan

    def set_device_plan(self, plan: DevicePlan) -> None:
        """Use ``plan`` (init, or a member joined). The CUDA backend is chosen only when the
        plan names CUDA devices and CUDA is available: otherwise the CPU one (no-op)."""
        backend = self._chosen_backend()
        if backend is None:
            backend = self._codec.backend
            wants_cuda = any(d.type == "cuda" for d in plan.devices)
            if wants_cuda and backend.name == "cpu" and torch.cuda.is_available():
                # as torch: CUDA's state is set up before any peer sends CUDA tensors here
                torch.cuda.init()  # type: ignore[no-untyped-call]
                backend = CudaBackend()
        if plan.used:
            install_receiver(backend)
        self._codec.set_device_plan(plan, backend)

    def _get_device_map(self, to: WorkerInfo) -> dict[torch.device, torch.device]:
        """torch's ``TensorPipeAgent._get_device_map``: this worker's map to ``to`` (empty:
        none), what its requests to ``to`` use."""
        return dict(self._codec.plan.maps.get(to.name, {}))

    def _get_backend_options(self) -> TensorPipeRpcBackendOptions:
        """torch's ``TensorPipeAgent._get_backend_options``: the options this agent runs with."""
        return self.options

    def device_member_joined(self, name: str, record: dict[str, Any] | None) -> None:
        """A member joined a dynamic group (it validated everyone's maps): responses to it
        use the inverse of its map to this worker, and default devices are derived again
        (torch's ``_update_group_membership``)."""
        plan = self._codec.plan
        _count, maps, _devices = maps_from_record(record)
        gpus = dict(plan.gpus)
        joined = gpus_from_record(record)
        if joined:
            gpus[name] = joined
        reverse = dict(plan.reverse)
        mine = maps.get(self.worker_info.name)
        if mine:
            reverse[name] = {v: k for k, v in mine.items()}
        else:
            reverse.pop(name, None)
        devices = plan.devices if self.options.devices else default_devices([], plan.maps, reverse)
        self.set_device_plan(DevicePlan(plan.maps, reverse, devices, gpus, plan.me))

    # -- start -----------------------------------------------------------------------------------
    def start_transport(self, secret: bytes, listen_host: str) -> PeerAddress:
        """Start the I/O thread and listen; return the address to publish."""
        opts = self.options
        config = TransportConfig(
            rank=self.worker_info.id,
            world_size=self.world_size,
            secret=secret,
            max_message_size=opts.max_message_size,
            heartbeat_interval=opts.heartbeat_interval,
            peer_timeout=opts.peer_timeout,
            handshake_timeout=_config.DEFAULT_HANDSHAKE_TIMEOUT,
            connect_timeout=max(opts.rpc_timeout, _config.DEFAULT_HANDSHAKE_TIMEOUT)
            if opts.rpc_timeout > 0
            else _config.DEFAULT_HANDSHAKE_TIMEOUT,
            use_unix_sockets=_config.env_flag(_config.ENV_UNIX_SOCKETS, True),
            server_ssl=opts.server_ssl_context,
            client_ssl=opts.client_ssl_context,
            fail_stop=opts.fail_stop or _config.env_flag(_config.ENV_FAIL_STOP, False),
            incarnation=self.incarnation,
            dynamic=self.dynamic,
        )
        self.secret = secret
        _layer.agent_starting(self)
        self._io.start()
        self._io.call_soon(join_openmp_runtime)
        transport = self._transport_factory(config, self._io, self, self._label)
        self._shared.transport = transport
        self._shared.describe = transport.wants_message_info
        self.address = transport.listen(listen_host)
        self.state = AgentState.LISTENING
        return self.address

    def set_peers(self, workers: list[WorkerInfo], addresses: dict[int, PeerAddress]) -> None:
        for info in workers:
            self._by_name[info.name] = info
            self._by_rank[info.id] = info
        for rank, address in addresses.items():
            if address.incarnation:
                self._incarnation_of[rank] = address.incarnation
        self.transport.set_peers(addresses)
        self._codec.set_peer_limits(addresses)
        self.state = AgentState.RUNNING

    # -- membership (dynamic groups) -------------------------------------------------------------
    def incarnation_of(self, rank: int) -> int:
        """The incarnation known for the member of ``rank`` (0: none known)."""
        return self._incarnation_of.get(rank, 0)

    def add_member(self, info: WorkerInfo, address: PeerAddress) -> None:
        """A member joined (or rejoined under its name: a new incarnation). Told twice (a
        join asked again after an answer was lost), nothing changes; an incarnation that was
        removed from the group (its join undone by the next holder of the membership token)
        is refused with ``RuntimeError``."""
        old = self._by_rank.get(info.id)
        known = self._incarnation_of.get(info.id, 0)
        if (info.id, address.incarnation) in self._gone:
            raise RuntimeError(
                f"worker {info.name} (rank {info.id}) incarnation {address.incarnation:016x} "
                "was removed from the RPC group: it cannot join as a member any more"
            )
        if old == info and known == address.incarnation:
            return
        if old is not None and old.name != info.name:
            self._by_name.pop(old.name, None)
        self._by_name[info.name] = info
        self._by_rank[info.id] = info
        self.departed.pop(info.name, None)
        self._incarnation_of[info.id] = address.incarnation
        self._codec.set_peer_limit(info.id, address.max_message_size)
        self.transport.add_peer(info.id, address)
        if old is not None and known and known != address.incarnation:
            self._membership_event("restarted", info, known)
        self._membership_event("joined", info, address.incarnation)

    def remove_member(self, rank: int, incarnation: int, reason: str = "it shut down") -> None:
        """The member of ``rank`` left the group (a graceful shutdown, or ``reason``): later
        calls to it fail at once naming it as departed; contexts it took part in are failed
        and cleaned."""
        info = self._by_rank.get(rank)
        if info == self.worker_info:
            return
        if incarnation:
            self._gone.add((rank, incarnation))
        if info is None:
            return
        if incarnation and self._incarnation_of.get(rank, incarnation) != incarnation:
            return  # a replaced incarnation says goodbye: the member itself stays
        del self._by_rank[rank]
        self._by_name.pop(info.name, None)
        self.departed[info.name] = info
        error = PeerFailureError(
            f"worker {info.name} (rank {rank}) has left the RPC group ({reason})",
            f"worker {info.name} (rank {rank})",
        )
        self.transport.remove_peer(rank, error)
        self._callbacks.submit(_layer.peer_failed, self, rank, error)
        self._membership_event("left", info, incarnation)

    def _membership_event(self, kind: MembershipKind, info: WorkerInfo, incarnation: int) -> None:
        event = MembershipEvent(kind, info, incarnation, time.time())
        self._stats.membership(kind)
        _log.info("membership: %s", event)
        for listener in list(self.membership_listeners):
            self._callbacks.submit(listener, event)

    def members(self) -> list[WorkerInfo]:
        """The current members (this worker included), by rank."""
        return self.get_worker_infos()

    def _label(self, rank: int) -> str:
        info = self._by_rank.get(rank)
        if info is None:  # a member that left: errors about it still name it
            info = next((i for i in list(self.departed.values()) if i.id == rank), None)
        return f"worker {info.name} (rank {rank})" if info else f"rank {rank}"

    # -- lookups ---------------------------------------------------------------------------------
    def get_worker_info(self, to: str | int | None = None) -> WorkerInfo:
        if to is None:
            return self.worker_info
        if isinstance(to, str):
            info = self._by_name.get(to)
            if info is None:
                gone = self.departed.get(to)
                raise RuntimeError(
                    f"name:{self.worker_info.name},rank:{self.worker_info.id} "
                    f"could not find destination name {to}"
                    + (f" (worker {to} (rank {gone.id}) has left the RPC group)" if gone else "")
                )
            return info
        info = self._by_rank.get(to)
        if info is None:
            left = next((i for i in list(self.departed.values()) if i.id == to), None)
            raise RuntimeError(
                f"name:{self.worker_info.name},rank:{self.worker_info.id} "
                f"could not find destination id {to}"
                + (f" (worker {left.name} (rank {to}) has left the RPC group)" if left else "")
            )
        return info

    def get_worker_infos(self) -> list[WorkerInfo]:
        """Every worker of the group, by rank."""
        return [self._by_rank[r] for r in sorted(self._by_rank)]

    def get_metrics(self) -> dict[str, str]:
        """torch's agent metrics, with this agent's values (strings, as torch's):
        ``agent.thread_pool_size`` (``num_worker_threads``), ``agent.num_idle_threads`` (pool
        slots free now), ``agent.client_active_calls`` (user calls from here awaiting their
        response), ``agent.server_active_calls`` (requests being served here, including those
        waiting on nested calls) and ``agent.server_active_async_calls`` (``@async_execution``
        requests whose future has not completed)."""
        pool = self._workers
        busy = pool.busy()
        metrics = {
            "agent.server_active_async_calls": str(self._serving.serving_async),
            "agent.client_active_calls": str(self._outgoing.active_calls()),
            "agent.server_active_calls": str(busy),
            "agent.num_idle_threads": str(max(0, pool.max_threads - busy)),
            "agent.thread_pool_size": str(pool.max_threads),
        }
        if self._serving.gil_profiling:
            total, count = self._serving.gil_wait
            average_us = total / count * 1e6 if count else 0.0
            metrics["agent.gil_average_wait_time_us"] = f"{average_us:f}"
        return metrics

    def enable_gil_profiling(self, flag: bool) -> None:
        """torch's ``rpc.enable_gil_profiling``: with ``flag``, time how long each request
        served here waits between its arrival and the moment a worker thread runs Python for
        it -- the thread's wake-up and its taking of the GIL, plus any wait for a free thread
        -- and report the average since enabling as ``agent.gil_average_wait_time_us`` in
        :meth:`get_metrics` / :meth:`get_debug_info` (torch times its own GIL acquisitions;
        in a pure-Python agent this hand-off is where the GIL is waited for). Costs nothing
        while off; turning it off keeps the figures, turning it on again resets them."""
        self._serving.enable_gil_profiling(flag)

    def get_debug_info(self) -> dict[str, str]:
        """torch's ``RpcAgent.get_debug_info()``: the metrics of :meth:`get_metrics`."""
        return self.get_metrics()

    @property
    def transport(self) -> Transport:
        transport = self._shared.transport
        assert transport is not None
        return transport

    @property
    def _transport(self) -> Transport | None:
        """The transport, or None before :meth:`start_transport`."""
        return self._shared.transport

    @property
    def state(self) -> AgentState:
        """Where the agent is in its life (``CREATED`` ... ``STOPPED``)."""
        return self._shared.state

    @state.setter
    def state(self, state: AgentState) -> None:
        self._shared.state = state
        self._shared.stopped = state.stopped

    @property
    def rpc_timeout(self) -> float:
        """The default timeout of new calls (seconds; 0: none); ``rpc._set_rpc_timeout``
        changes it."""
        return self._shared.rpc_timeout

    @rpc_timeout.setter
    def rpc_timeout(self, timeout: float) -> None:
        self._shared.rpc_timeout = timeout

    @property
    def _calls(self) -> CallTable:
        """The outgoing stage's calls table (what is in flight from here)."""
        return self._outgoing.calls

    def statistics(self) -> TransportStatistics:
        """The transport's counters (connections, handshakes, dead peers, stalls)."""
        return self.transport.statistics()

    def agent_statistics(self) -> AgentStatistics:
        """A snapshot of this agent: its state, what is in flight, and its traffic per peer
        (calls sent and failed, requests served and failed, bytes), with the transport's
        counters."""
        names = {rank: info.name for rank, info in self._by_rank.items()}
        return AgentStatistics(
            worker_name=self.worker_info.name,
            state=self.state,
            calls_in_flight=len(self._calls),
            requests_in_flight=self._workers.busy(),
            peers=self._stats.peers(names),
            transport=self._transport.statistics() if self._transport is not None else None,
            membership=self._stats.membership_counts(),
            uptime=self._stats.uptime,
            layers=self._layer_metrics(),
        )

    def _layer_metrics(self) -> dict[str, float]:
        previous = bind_thread(self)
        try:
            return _layer.layer_metrics(self)
        finally:
            bind_thread(previous)

    def __repr__(self) -> str:
        info = self.worker_info
        return (
            f"<RpcAgent {info.name} (rank {info.id} of {self.world_size}) {self.state.value}, "
            f"{len(self._calls)} calls in flight>"
        )

    def peer_is_dead(self, dst: int) -> bool:
        """True once worker ``dst`` is known to be dead."""
        return self._shared.peer_is_dead(dst)

    def blocking(self) -> contextlib.AbstractContextManager[None]:
        """A block that waits for other workers: on a worker or callback thread, its pool slot
        is free meanwhile (so nested calls cannot exhaust the pool)."""
        return _pool.blocking(self._pools)

    def schedule(self, fn: Callable[[], Any]) -> None:
        """Run ``fn`` soon on a callback thread. Safe from anywhere, even ``__del__``: it takes
        no lock on the calling thread."""
        self._io.call_soon(self._run_scheduled, fn)

    def _run_scheduled(self, fn: Callable[[], Any]) -> None:
        if not self.state.stopped:
            self._callbacks.submit(fn)

    # -- calls and messages out (the outgoing and one-way stages) --------------------------------
    def call_sync(
        self,
        dst: WorkerInfo,
        func: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        timeout: float = -1.0,
        *,
        force: bool | None = True,
        internal: bool = False,
    ) -> Any:
        """Send a request and wait for its result, raising remote errors
        (:meth:`Outgoing.call_sync <._outgoing.Outgoing.call_sync>`)."""
        return self._outgoing.call_sync(
            dst, func, args, kwargs, timeout, force=force, internal=internal
        )

    def call_async(
        self,
        dst: WorkerInfo,
        func: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        timeout: float = -1.0,
        *,
        force: bool | None = True,
        internal: bool = False,
    ) -> torch.futures.Future[Any]:
        """Send a request; return a ``torch.futures.Future`` of its result
        (:meth:`Outgoing.call_async <._outgoing.Outgoing.call_async>`)."""
        return self._outgoing.call_async(
            dst, func, args, kwargs, timeout, force=force, internal=internal
        )

    def call_internal(
        self,
        dst: int,
        func: Any,
        args: tuple[Any, ...],
        on_done: AnswerCallback,
        timeout: float = -1.0,
        *,
        device_map: DeviceMap | None = None,
    ) -> None:
        """An internal request with no future, its answer handed to ``on_done`` where it
        arrives (:meth:`Outgoing.call_internal <._outgoing.Outgoing.call_internal>`)."""
        self._outgoing.call_internal(dst, func, args, on_done, timeout, device_map=device_map)

    def active_calls(self) -> int:
        """User calls from this worker still waiting for their response."""
        return self._outgoing.active_calls()

    def wait_until_idle(self, deadline: float | None) -> None:
        """Wait until no user call from this worker is in flight (or raise at ``deadline``)."""
        self._outgoing.wait_until_idle(deadline)

    def notify(
        self,
        dst: int,
        func: Any,
        args: tuple[Any, ...],
        *,
        later: bool = False,
        device_map: DeviceMap | None = None,
    ) -> None:
        """Send a one-way internal message (:meth:`OneWay.notify <._oneway.OneWay.notify>`)."""
        self._oneway.notify(dst, func, args, later=later, device_map=device_map)

    def post(
        self, dst: int, func: Any, args: tuple[Any, ...], *, later: bool = False, attempts: int = 1
    ) -> None:
        """:meth:`notify` for a message nothing waits for, never blocking the caller
        (:meth:`OneWay.post <._oneway.OneWay.post>`)."""
        self._oneway.post(dst, func, args, later=later, attempts=attempts)

    def send_with_retries(
        self, dst: int, func: Any, args: tuple[Any, ...], attempts: int = RETRY_ATTEMPTS
    ) -> torch.futures.Future[Any]:
        """An internal message whose handler is idempotent, retried
        (:meth:`OneWay.send_with_retries <._oneway.OneWay.send_with_retries>`)."""
        return self._oneway.send_with_retries(dst, func, args, attempts)

    # -- receiving (I/O thread) ------------------------------------------------------------------
    def on_frame(self, conn: Link, frame: Frame) -> None:
        kind = frame.kind
        if kind == Kind.REQUEST:
            self._serving.on_request(conn, frame)
        elif kind == Kind.NOTIFY:
            self._serving.on_notify(conn, frame)
        else:
            self._outgoing.on_answer(frame)

    def on_connection_lost(self, conn: Link, error: Exception, *, peer_dead: bool) -> None:
        self._outgoing.fail_calls_on(conn, error)
        if peer_dead:
            self._callbacks.submit(_layer.peer_failed, self, conn.peer, error)

    # -- shutdown --------------------------------------------------------------------------------
    def stop(self, *, graceful: bool) -> None:
        """Close connections (flushing first when ``graceful``), fail what still waits, and end
        every thread the agent owns. Idempotent. Without grace, no response goes out once the
        stop began (as torch's agent): the peers see the connections close, as from a worker
        that died, never an answer made of this stop."""
        if self.state.stopped:
            return
        if not graceful:
            self._shared.silenced = True  # (before STOPPING: an error made of the stop is not sent)
        self.state = AgentState.STOPPING
        if graceful:
            # Requests being served finish and write their responses before the connections
            # close (a follower leaving shutdown's last all-gather must not close the connection
            # before its answer to the leader's broadcast has gone out).
            self._workers.stop()
        if self._shared.transport is not None:
            self._shared.transport.close(graceful)
        self._dialer.stop(timeout=0.2)
        self._outgoing.fail_all_calls(
            RpcShutdownError("RPC agent was shut down before the call completed")
        )
        self._device_lane.stop()
        self._workers.stop()
        self._callbacks.stop()
        self._io.stop()
        self.keepalive.clear()
        _layer.agent_stopped(self)
        self.wire_choices.undo()
        self.state = AgentState.STOPPED
