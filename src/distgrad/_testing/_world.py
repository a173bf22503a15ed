"""In-memory worlds: N RPC agents in one process, joined by the in-memory transport.

For tests that need many workers but not many processes: a world starts in milliseconds, every
message still crosses the real pickler, frame parser and threads (see ``_transport/_inmemory``),
and faults can be injected into chosen messages (``faults=``, see ``_transport/_faulty``).

Several agents share one process, so each is *isolated*: every thread it owns is bound to it,
and so is each thread :meth:`World.run` runs a worker's code on; ``current_agent()`` and the
per-worker state of the layers above (autograd's contexts, group operations) follow that binding
(docs/design.md, "In-memory worlds")::

    with open_world(4) as world:
        world.run(train_step)          # train_step(rank) on 4 threads, one per worker

Every wait is bounded: :meth:`World.run` raises :class:`WorldTimeout` naming the workers that
had not finished (and the world is then stopped, which ends their calls with errors), and
leaving the block shuts every worker down -- gracefully if it can, abruptly otherwise.
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

from torch.distributed import HashStore  # type: ignore[attr-defined]

from .._devices._maps import plan_devices
from .._rpc import _api
from .._rpc._core import (
    RpcAgent,
    TensorPipeRpcBackendOptions,
    WorkerInfo,
    bind_thread,
    current_agent,
)
from .._rpc._group._dynamic import join_group
from .._rpc._group._lease import write_state
from .._rpc._group._rendezvous import address_record
from .._transport._base import TransportFactory
from .._transport._faulty import Fault, FaultPlan, FaultyTransport
from .._transport._inmemory import MemoryNetwork

__all__ = ["World", "WorldTimeout", "open_world", "worker_thread", "world_options"]

T = TypeVar("T")
_SECRET = b"in-memory world"


class WorldTimeout(AssertionError):
    """Workers of an in-memory world did not finish in time (their stacks are in the message)."""


def world_options(
    *,
    rpc_timeout: float = 10.0,
    heartbeat_interval: float = 0.1,
    peer_timeout: float = 1.0,
    num_worker_threads: int = 8,
) -> TensorPipeRpcBackendOptions:
    """Options for a world's agents: short bounds, so that a lost message or a frozen peer
    fails a test in about a second instead of a minute."""
    return TensorPipeRpcBackendOptions(
        num_worker_threads=num_worker_threads,
        rpc_timeout=rpc_timeout,
        heartbeat_interval=heartbeat_interval,
        peer_timeout=peer_timeout,
    )


class World:
    """The agents of an in-memory world (made by :func:`open_world`)."""

    def __init__(
        self,
        agents: list[RpcAgent],
        network: MemoryNetwork,
        timeout: float,
        faults: FaultPlan | None = None,
        store: Any = None,
    ) -> None:
        self.agents = agents
        #: the store of a dynamic world (a ``HashStore``): joins and leaves go through it
        self.store = store
        self.network = network
        self.timeout = timeout
        #: the fault plan of every worker's transport (``open_world(..., faults=...)``)
        self.faults = faults
        self._killed: set[int] = set()
        self._left: set[int] = set()

    def __repr__(self) -> str:
        return f"<World of {len(self.agents)} workers, killed={sorted(self._killed)}>"

    @property
    def size(self) -> int:
        return len(self.agents)

    def run(
        self,
        fn: Callable[..., T],
        *args: Any,
        ranks: list[int] | None = None,
        timeout: float | None = None,
    ) -> list[T]:
        """Run ``fn(rank, *args)`` for every worker (or ``ranks``) at once, each on its own thread
        bound to that worker; return the results in rank order. The first worker's exception (by
        rank) is raised; past ``timeout`` (default: the world's), :class:`WorldTimeout`."""
        chosen = list(range(self.size)) if ranks is None else list(ranks)
        results: dict[int, T] = {}
        errors: dict[int, BaseException] = {}

        def body(rank: int) -> None:
            bind_thread(self.agents[rank])
            try:
                results[rank] = fn(rank, *args)
            except BaseException as exc:
                errors[rank] = exc
            finally:
                bind_thread(None)

        threads = {
            rank: threading.Thread(
                target=body, args=(rank,), name=f"world-worker{rank}", daemon=True
            )
            for rank in chosen
        }
        for thread in threads.values():
            thread.start()
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        for thread in threads.values():
            thread.join(max(0.0, deadline - time.monotonic()))
        late = [rank for rank, thread in threads.items() if thread.is_alive()]
        if late:
            stacks = _stacks({threads[r].ident for r in late})
            raise WorldTimeout(
                f"workers {late} did not finish within "
                f"{self.timeout if timeout is None else timeout:g}s\n{stacks}"
            )
        for rank in chosen:
            if rank in errors:
                raise errors[rank]
        return [results[rank] for rank in chosen]

    def run_on(self, rank: int, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on a thread bound to worker ``rank`` (not passed the rank)."""
        return self.run(lambda _rank: fn(*args), ranks=[rank])[0]

    def kill(self, rank: int) -> None:
        """Stop worker ``rank`` abruptly: no goodbye, so its peers see it die."""
        self._killed.add(rank)
        self.agents[rank].stop(graceful=False)

    def alive(self) -> list[int]:
        return [rank for rank in range(self.size) if rank not in self._killed | self._left]

    # -- dynamic worlds (open_world(..., dynamic=True)) -----------------------------------------
    def join(
        self,
        rank: int | None = None,
        name: str | None = None,
        store: Any = None,
        options: TensorPipeRpcBackendOptions | None = None,
    ) -> int:
        """Start a new agent and join it to the (dynamic) world through the world's store, as
        ``init_rpc(name, rank, world_size=None)`` does; return its rank. A rank given that was
        killed or left restarts that member under its name: a new incarnation. ``store`` is the
        store this joiner talks to (default: the world's; a test may wrap it); ``options`` its
        options (default: worker0's)."""
        rank = self.size if rank is None else rank
        if rank < self.size and rank in self.alive():
            raise ValueError(f"rank {rank} is a running member of the world")
        name = name if name is not None else f"worker{rank}"
        factory: TransportFactory = self.network.factory
        if self.faults is not None:
            factory = FaultyTransport.factory(factory, self.faults)
        options = self.agents[0].options if options is None else options
        agent = RpcAgent(name, rank, 0, options, transport=factory, isolated=True, dynamic=True)
        previous = bind_thread(agent)
        try:
            address = agent.start_transport(_SECRET, "memory")
        finally:
            bind_thread(previous)
        if rank < self.size:
            self.agents[rank] = agent
        else:
            self.agents.append(agent)
        self._killed.discard(rank)
        self._left.discard(rank)
        store = self.store if store is None else store
        agent.keepalive.append(store)
        self.run_on(rank, lambda: join_group(agent, store, address, False, options.rpc_timeout))
        return rank

    def leave(self, rank: int, timeout: float | None = None) -> None:
        """Worker ``rank`` leaves gracefully (``rpc.shutdown()`` of a dynamic member; with
        ``timeout``, ``rpc.shutdown(timeout=timeout)``)."""
        if timeout is None:
            self.run_on(rank, _api.shutdown)
        else:
            self.run_on(rank, _api.shutdown, True, timeout)
        self._left.add(rank)

    def close(self, *, graceful: bool = True) -> None:
        """Shut every worker down (``rpc.shutdown`` on each, at once); if that fails or does not
        finish in time, stop them abruptly and re-raise. Always stops every agent. A world with
        a killed worker is stopped abruptly (a graceful shutdown needs every worker)."""
        ranks = self.alive()
        try:
            if graceful and ranks and not self._killed:
                self.run(_shutdown, self.timeout, ranks=ranks, timeout=self.timeout + 5.0)
        finally:
            for agent in self.agents:
                agent.stop(graceful=False)


def worker_thread(target: Callable[..., object], *args: object) -> threading.Thread:
    """A thread (not started) that runs ``target(*args)`` as part of the calling thread's worker.
    In a world, a thread your code starts belongs to no worker (thread-locals are not
    inherited); one made here is bound to the same agent. In a real worker it is a plain
    thread."""
    agent = current_agent()

    def run() -> None:
        bind_thread(agent if agent is not None and agent.isolated else None)
        try:
            target(*args)
        finally:
            bind_thread(None)

    return threading.Thread(target=run, daemon=True)


def _shutdown(rank: int, timeout: float) -> None:
    _api.shutdown(graceful=True, timeout=timeout)


def _stacks(idents: set[int | None]) -> str:
    frames = sys._current_frames()
    parts = []
    for ident in idents:
        frame = frames.get(ident) if ident is not None else None
        if frame is not None:
            parts.append("".join(traceback.format_stack(frame)))
    return "\n".join(parts)


@contextmanager
def open_world(
    world_size: int,
    *,
    options: TensorPipeRpcBackendOptions | Sequence[TensorPipeRpcBackendOptions] | None = None,
    faults: FaultPlan | Iterable[Fault] | None = None,
    timeout: float = 30.0,
    dynamic: bool = False,
) -> Iterator[World]:
    """Start ``world_size`` agents named ``worker0`` ... in this process; shut them down on exit.

    ``options`` defaults to :func:`world_options` (a sequence: one per rank; their device
    maps are validated and planned as ``init_rpc`` does). With ``faults`` (rules, or a plan), every
    worker's transport injects them (``World.faults`` is the plan; an empty list gives a plan
    to add rules to later). ``timeout`` bounds each :meth:`World.run` and the shutdown. With
    ``dynamic``, the agents are those of a dynamic group: :meth:`World.join` adds (or restarts)
    members, :meth:`World.leave` removes them (``rpc.shutdown()``)."""
    if world_size < 1:
        raise ValueError("world_size must be at least 1")
    options = options if options is not None else world_options()
    per_rank = (
        [options] * world_size
        if isinstance(options, TensorPipeRpcBackendOptions)
        else list(options)
    )
    if len(per_rank) != world_size:
        raise ValueError(f"{len(per_rank)} options for a world of {world_size}")
    plan = None
    if faults is not None:
        plan = faults if isinstance(faults, FaultPlan) else FaultPlan(faults)
    network = MemoryNetwork()
    agents: list[RpcAgent] = []
    try:
        addresses = {}
        for rank in range(world_size):
            factory: TransportFactory = network.factory
            if plan is not None:
                factory = FaultyTransport.factory(factory, plan)
            agent = RpcAgent(
                f"worker{rank}",
                rank,
                0 if dynamic else world_size,
                per_rank[rank],
                transport=factory,
                isolated=True,
                dynamic=dynamic,
            )
            agents.append(agent)
            previous = bind_thread(agent)
            try:
                addresses[rank] = agent.start_transport(_SECRET, "memory")
            finally:
                bind_thread(previous)
        workers = [WorkerInfo(f"worker{rank}", rank) for rank in range(world_size)]
        for agent in agents:
            agent.set_peers(workers, addresses)
        names = [w.name for w in workers]
        records = {agent.worker_info.name: agent.device_record() for agent in agents}
        for agent in agents:
            agent.set_device_plan(plan_devices(agent.worker_info.name, names, records))
        store = None
        if dynamic:
            store = HashStore()
            write_state(
                store,
                {w.id: address_record(w, addresses[w.id], False, records[w.name]) for w in workers},
            )
            for agent in agents:
                agent.keepalive.append(store)
    except BaseException:
        for agent in agents:
            agent.stop(graceful=False)
        raise
    world = World(agents, network, timeout, plan, store)
    try:
        yield world
    except BaseException:
        world.close(graceful=False)
        raise
    world.close()
