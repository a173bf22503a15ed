"""One distributed backward pass as one worker sees it (:class:`Pass`): its sources, recv
functions, engine runs and messages; the pass's messages and the parts of its state. The
module docstring of ``_engine`` explains how a pass runs."""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from .._errors import DistgradError
from .._rpc._core import current_agent, set_future_error
from .._rpc._core import profiling as _profiling
from .._rpc._core import tracing as _tracing
from . import _metrics
from ._context import CONTAINER, DistAutogradContext
from ._functions import (
    RECV_NAME,
    SEND_NAME,
    Reach,
    RecvRecord,
    SendRecord,
    reach_of,
    run_engine,
)
from ._hooks import (
    GRAD_LOCK,
    HookedLeaf,
    borrowed_grads,
    hooks_set_aside,
    is_hooked,
    run_accumulators,
)

_profiler_enabled: Any = torch.autograd._profiler_enabled  # type: ignore[attr-defined]
ROOT = -1  # the source key of the roots; send functions use their message id


_pass_ids = itertools.count()
_ALL_PASSES: set[Pass] = set()
_PASSES_LOCK = threading.Lock()


class BackwardError(DistgradError):
    """A distributed backward pass failed (a ``RuntimeError``, as torch's error).

    The message is the hop-by-hop chain, each worker prefixing ``Error on Node N: `` as the
    error travels back to the caller of ``backward``, e.g. ``Error on Node 0: Error on Node 1:
    boom``. The context survives the failure."""

    verbatim_over_rpc = True


def _done_future() -> torch.futures.Future[None]:
    future: torch.futures.Future[None] = torch.futures.Future()
    future.set_result(None)
    return future


class GradUpdate(NamedTuple):
    """Gradients for one send function of a pass (or, with ``grads`` None, only its final
    marker): what the driving thread's queue and :meth:`Pass.on_grad_messages` take."""

    msg_id: int
    grads: list[torch.Tensor] | None
    #: the last message for this send function: ``total`` messages carried gradients
    final: bool
    total: int


class GradMessage(NamedTuple):
    """A gradient message between workers (the one argument of ``_grad_message`` and
    ``_late_grad_message``)."""

    context_id: int
    pass_id: tuple[int, int]
    retain: bool
    src: int
    update: GradUpdate


class EngineRun(NamedTuple):
    """One source of an engine run: its roots (tensors or gradient edges) and their
    gradients; ``last``: the source's last run (its graph need not be retained for it)."""

    key: int
    roots: tuple[Any, ...]
    grads: list[torch.Tensor]
    last: bool


class PassMessages(NamedTuple):
    """The handlers of a pass's messages to its peers: the engine's (``_engine`` makes every
    pass with them; this module is below it and never imports it)."""

    #: ``(context_id, pass_id, retain, src)``: join a worker that gets no gradient message
    start: Callable[..., Any]
    #: a first gradient message to a worker (answered when that worker's part is done)
    grad: Callable[..., Any]
    #: a later one (one-way)
    late_grad: Callable[..., Any]


class _Answer:
    """For the driving thread: the answer to one of its first messages."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException | None) -> None:
        self.error = error


class _Source:
    __slots__ = (
        "accumulators",
        "expected",
        "final_seen",
        "key",
        "leaves",
        "processed",
        "recvs",
        "resolved",
        "shared",
    )

    def __init__(self, key: int) -> None:
        self.key = key
        self.leaves: dict[int, torch.Tensor] = {}
        self.accumulators: dict[int, Any] = {}  # the leaves' AccumulateGrad nodes
        self.recvs: set[int] = set()
        self.shared = False
        self.resolved = False
        self.final_seen = False
        self.expected = 0
        self.processed = 0


class _RecvState:
    __slots__ = ("final", "record", "sent", "sources")

    def __init__(self, record: RecvRecord) -> None:
        self.record = record
        self.sources: set[int] = set()
        self.sent = 0
        self.final = False


class Pass:
    """One worker's part of one distributed backward pass over one context."""

    def __init__(
        self,
        ctx: DistAutogradContext,
        pass_id: tuple[int, int],
        retain_graph: bool,
        roots: list[torch.Tensor] | None,
        messages: PassMessages,
    ) -> None:
        self.ctx = ctx
        self.messages = messages
        self.pass_id = pass_id
        self.retain_graph = retain_graph
        self.roots = roots
        self.worker_id = CONTAINER.worker_id
        self.sources: dict[int, _Source] = {}
        self.recvs: dict[int, _RecvState] = {}
        self.outstanding = 0  # first messages sent whose answer has not come yet
        # workers known to take part: those messaged, and those a message came from
        self.in_touch: set[int] = set()
        self.heard_from: set[int] = set()
        self.done: torch.futures.Future[None] = torch.futures.Future()
        self.finished = False
        #: on the worker that called backward: gradient messages and answers for its thread
        self.driver: queue.SimpleQueue[GradUpdate | _Answer | None] | None = None
        self._keep: list[Reach] = []  # graph node wrappers stay alive while ids are compared
        #: leaves whose gradient meets hooks, by id: they are accumulated once per pass
        self.hooked: dict[int, HookedLeaf] = {}
        #: this worker's part of the pass as a span of the pass's trace (calls traced only)
        self.span: _tracing.Span | None = None
        if _tracing.active:
            self.span = _pass_span(pass_id, self.worker_id)

    # -- joining -------------------------------------------------------------------------------
    def start(self) -> None:
        """Analyse the local graph, tell the known workers, finalise unreachable recvs."""
        ctx = self.ctx
        sends: dict[int, SendRecord] = dict(ctx.send_functions)
        recv_records: dict[int, RecvRecord] = dict(ctx.recv_functions)
        by_node = {id(r.node): r.msg_id for r in recv_records.values()}
        for msg_id, record in recv_records.items():
            self.recvs[msg_id] = _RecvState(record)
        reaches: dict[int, Reach] = {k: r.get_reach() for k, r in sends.items()}
        if self.roots is not None:
            reaches[ROOT] = reach_of([root.grad_fn for root in self.roots])
        self._keep.extend(reaches.values())
        seen: set[int] = set()
        for key, reach in reaches.items():
            source = _Source(key)
            source.leaves = reach.leaves
            source.accumulators = reach.accumulators
            source.recvs = {by_node[n] for n in reach.recv_nodes if n in by_node}
            ids = reach.nodes.keys()
            if not seen.isdisjoint(ids):  # shares nodes with a source before it: which ones
                source.shared = True
                for other_key, other in self.sources.items():
                    if not ids.isdisjoint(reaches[other_key].nodes):
                        other.shared = True
            seen.update(ids)
            self.sources[key] = source
        for key, source in self.sources.items():
            for msg_id in source.recvs:
                self.recvs[msg_id].sources.add(key)
        with _PASSES_LOCK:
            _ALL_PASSES.add(self)
        self._flush_recvs()

    def flood(self) -> None:
        """Make sure the peer of every send function takes part: a peer this worker has
        neither messaged nor heard from in this pass gets ``START``. (Called after the joining
        message -- or the roots -- was processed, so a peer that gets gradients anyway, or
        that is known to take part, gets nothing extra.)"""
        if self.finished:
            return
        for record in self.ctx.send_functions.values():
            worker = record.dst
            if worker != self.worker_id and worker not in self.in_touch:
                self._message(
                    worker,
                    self.messages.start,
                    (self.ctx.context_id, self.pass_id, self.retain_graph, self.worker_id),
                )

    # -- running torch's engine ------------------------------------------------------------------
    def run(self, items: list[EngineRun]) -> None:
        """One engine run from several sources."""
        outputs: list[Any] = []
        grad_outputs: list[torch.Tensor] = []
        leaves: dict[int, torch.Tensor] = {}
        accumulators: dict[int, Any] = {}
        recv_ids: set[int] = set()
        retain = self.retain_graph
        finishing: list[_Source] = []
        for key, outs, grads, last in items:
            source = self.sources[key]
            outputs.extend(outs)
            grad_outputs.extend(grads)
            leaves.update(source.leaves)
            accumulators.update(source.accumulators)
            recv_ids.update(source.recvs)
            retain = retain or source.shared or not last
            if last:
                finishing.append(source)
        leaf_list = list(leaves.values())
        recv_list = sorted(recv_ids)
        inputs: list[Any] = list(leaf_list)
        for msg_id in recv_list:
            inputs.extend(self.recvs[msg_id].record.edges)
        if not inputs:
            return
        hooked = [leaf for leaf in leaf_list if is_hooked(leaf, accumulators[id(leaf)])]
        if hooked:
            with GRAD_LOCK, hooks_set_aside(hooked, "_backward_hooks"):
                captured = list(run_engine(outputs, grad_outputs, inputs, retain))
        else:
            captured = list(run_engine(outputs, grad_outputs, inputs, retain))
        # The run takes the incoming gradients over: once torch's engine is done with them,
        # nothing here refers to them any more (the message's lists are emptied), so what the
        # engine built on them -- a sparse gradient's values are a view of the embedding
        # output's gradient -- may be stored without a copy when no user code kept them.
        grad_outputs.clear()
        for item in items:
            if isinstance(item.grads, list):
                item.grads.clear()
        position = len(leaf_list)
        recv_grads: list[list[torch.Tensor | None]] = []
        for msg_id in recv_list:
            width = len(self.recvs[msg_id].record.edges)
            recv_grads.append(captured[position : position + width])
            position += width
        hooked_ids = {id(leaf) for leaf in hooked}
        pairs = []
        for index, leaf in enumerate(leaf_list):
            grad = captured[index]
            if grad is None:
                continue
            captured[index] = None  # (the pair holds the engine's gradient alone: see below)
            if id(leaf) in hooked_ids:
                pending = self.hooked.get(id(leaf))
                if pending is None:
                    pending = self.hooked[id(leaf)] = HookedLeaf(leaf, accumulators[id(leaf)])
                pending.add(grad)
            else:
                pairs.append((leaf, grad))
        grad = None
        if pairs:
            # a gradient that only its pair refers to is taken over without a copy
            self.ctx.accumulate_grads(pairs)
        del pairs
        # Sources whose last message this was are resolved *before* the recv gradients go out,
        # so a recv function they finish sends its gradients and "final" in one message.
        for source in finishing:
            source.resolved = True
        for msg_id, captured_recv in zip(recv_list, recv_grads, strict=True):
            state = self.recvs[msg_id]
            self._send_grads(state, state.record.fill(captured_recv))

    def _flush_hooked(self) -> None:
        """Run the hooks of hooked leaves that no unresolved source can reach any more, once,
        on their whole gradient of this pass (``_hooks``)."""
        ready = [
            pending
            for key, pending in self.hooked.items()
            if pending.grad is not None
            and all(s.resolved for s in self.sources.values() if key in s.leaves)
        ]
        if not ready:
            return
        ctx = self.ctx
        # every hooked leaf of the pass is lent: a reducer's last hook may write any of them
        lent = [pending.variable for pending in self.hooked.values()]
        with GRAD_LOCK, CONTAINER.forced_current(ctx.context_id):
            with borrowed_grads(lent, ctx.grads_of(lent)):
                run_accumulators(ready)
                results = [(variable, variable.grad) for variable in lent]
            ctx.replace_grads(results)

    # -- messages --------------------------------------------------------------------------------
    def _send_grads(self, state: _RecvState, grads: list[torch.Tensor] | None) -> None:
        """Send gradients (or, with ``None``, only the final marker) for a recv function."""
        if grads is not None:
            state.sent += 1
        final = self._recv_ready(state)
        if final:
            state.final = True
        elif grads is None:
            return
        if _profiler_enabled():  # the recv function's event: torch's node sends its gradients
            with torch.autograd.profiler.record_function(RECV_NAME):
                self._send_grad_message(state, grads, final)
        else:
            self._send_grad_message(state, grads, final)

    def _send_grad_message(
        self, state: _RecvState, grads: list[torch.Tensor] | None, final: bool
    ) -> None:
        record = state.record
        _metrics.gradients_sent(self.worker_id, grads)
        update = GradUpdate(record.msg_id, grads, final, state.sent)
        message = GradMessage(
            self.ctx.context_id, self.pass_id, self.retain_graph, self.worker_id, update
        )
        self._message(record.src, self.messages.grad, (message,), record.device_map)

    def _recv_ready(self, state: _RecvState) -> bool:
        return all(self.sources[key].resolved for key in state.sources)

    def _flush_recvs(self) -> None:
        """Run the hooks of leaves that are complete; send final markers for recv functions
        whose sources are all resolved."""
        if self.hooked:
            self._flush_hooked()
        for state in self.recvs.values():
            if not state.final and self._recv_ready(state):
                self._send_grads(state, None)
        self._check_done()

    def _message(
        self,
        worker: int,
        func: Any,
        args: tuple[Any, ...],
        device_map: dict[torch.device, torch.device] | None = None,
    ) -> None:
        agent = current_agent()
        if agent is None:
            raise BackwardError(
                "RPC has not been initialized. Call torch.distributed.rpc.init_rpc first."
            )
        if self.span is not None:  # its messages are calls of the pass's trace
            previous = _tracing.set_current(self.span)
            try:
                self._send_message(agent, worker, func, args, device_map)
            finally:
                _tracing.set_current(previous)
            return
        self._send_message(agent, worker, func, args, device_map)

    def _send_message(
        self,
        agent: Any,
        worker: int,
        func: Any,
        args: tuple[Any, ...],
        device_map: dict[torch.device, torch.device] | None,
    ) -> None:
        if _profiling.wants(func):  # a profiled pass: through the agent's profiled calls
            self._message_profiled(agent, worker, func, args)
            return
        if worker in self.heard_from:
            # It already takes part, so this is not its first message: it needs no answer
            # (one would say nothing about the work it causes, which that worker's own part
            # covers, and waiting for it would add a round trip). A one-way message; a failure
            # there fails that worker's part, which reaches the caller of backward through its
            # own first message's answer; a lost peer is reported by the agent.
            assert func is self.messages.grad  # START goes only to workers not in touch yet
            agent.notify(worker, self.messages.late_grad, args, device_map=device_map)
            return
        agent.call_internal(worker, func, args, self._on_answer, device_map=device_map)
        self.in_touch.add(worker)
        self.outstanding += 1

    def _message_profiled(self, agent: Any, worker: int, func: Any, args: tuple[Any, ...]) -> None:
        """As :meth:`_message`, as a request through ``call_async`` (which records it in the
        profiler's trace); a late message's answer only matters if it is an error."""
        first = worker not in self.heard_from
        future = agent.call_async(agent.get_worker_info(worker), func, args, {}, 0, internal=True)
        self.in_touch.add(worker)
        if first:
            self.outstanding += 1

        def answered(done: torch.futures.Future[Any]) -> None:
            try:
                done.wait()
            except BaseException as exc:
                if first:
                    self._on_answer(None, exc)
                else:
                    with self.ctx.lock:
                        self.fail(exc)
                return
            if first:
                self._on_answer(None, None)

        future.add_done_callback(answered)

    def _on_answer(self, _result: Any, error: BaseException | None) -> None:
        """The answer to a first message (on the I/O thread: quick, no lock here)."""
        driver = self.driver
        if driver is not None:
            driver.put(_Answer(error))
            return
        agent = current_agent()
        if agent is not None:
            agent.schedule(lambda: self._answered(error))

    def _answered(self, error: BaseException | None) -> None:
        with self.ctx.lock:
            self.outstanding -= 1
            if error is not None:
                self.fail(error)
            else:
                self._check_done()

    # -- resolution and completion ---------------------------------------------------------------
    def resolve(self, key: int) -> None:
        self.sources[key].resolved = True
        self._flush_recvs()

    def on_grad_messages(self, messages: list[GradUpdate]) -> None:
        """Process gradient messages: the ones with gradients in one engine run (a subgraph
        shared by their send functions then runs once for all of them)."""
        items: list[EngineRun] = []
        touched: list[int] = []
        for msg_id, grads, final, total in messages:
            source = self.sources.get(msg_id)
            record: SendRecord | None = self.ctx.send_functions.get(msg_id)
            if source is None or record is None:
                raise BackwardError(
                    f"Could not find send function for autograd message id: {msg_id}"
                )
            if final:
                source.final_seen = True
                source.expected = total
            if grads is not None:
                source.processed += 1
                last = source.final_seen and source.processed == source.expected
                if _profiler_enabled():  # the send function's event, as torch's node has
                    with torch.autograd.profiler.record_function(SEND_NAME):
                        pass
                items.append(EngineRun(msg_id, record.get_roots(), grads, last))
            touched.append(msg_id)
        if items:
            self.run(items)
        for msg_id in touched:
            source = self.sources[msg_id]
            if source.final_seen and source.processed == source.expected:
                source.resolved = True
        self._flush_recvs()

    def _check_done(self) -> None:
        if self.finished or self.outstanding > 0:
            return
        if not all(s.resolved for s in self.sources.values()):
            return
        if not all(r.final for r in self.recvs.values()):
            return
        self._finish()
        self.done.set_result(None)

    def fail(self, error: BaseException) -> None:
        if self.finished:
            return
        self._finish("error")
        detail = str(error) if str(error) else repr(error)
        failure = BackwardError(f"Error on Node {self.worker_id}: {detail}")
        set_future_error(self.done, failure)

    def _finish(self, status: str = "ok") -> None:
        self.finished = True
        if self.span is not None:
            self.span.end(status)
            self.span = None
        if self.driver is not None:
            self.driver.put(None)  # wake the driving thread
        if self.ctx.pass_state is self:
            self.ctx.pass_state = None
        self.ctx.last_pass_id = self.pass_id
        self._keep.clear()
        with _PASSES_LOCK:
            _ALL_PASSES.discard(self)

    def waits_on(self, worker: int) -> bool:
        """True if this pass still needs something from ``worker``."""
        for key, source in self.sources.items():
            if key != ROOT and not source.resolved and self.ctx.send_functions[key].dst == worker:
                return True
        return False


def _pass_span(pass_id: tuple[int, int], worker: int) -> _tracing.Span:
    """This worker's span of the pass ``pass_id``: the trace's root on the worker that drives
    it, a child of that root elsewhere (ids derived from the pass id: ``pass_trace``)."""
    agent = current_agent()
    trace_id, root = _tracing.pass_trace(pass_id)
    driver = pass_id[0] == worker
    return _tracing.Span(
        name="distgrad.autograd.backward" if driver else "distgrad.autograd.backward part",
        trace_id=trace_id,
        span_id=root if driver else _tracing.new_span_id(),
        parent_id=None if driver else root,
        kind="internal",
        worker=agent.worker_info.name if agent is not None else str(worker),
        start_ns=time.time_ns(),
        attributes={"distgrad.pass_id": f"{pass_id[0]}:{pass_id[1]}"},
    )
