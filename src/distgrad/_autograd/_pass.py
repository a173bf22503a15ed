"""One distributed backward pass as one worker sees it (:class:`Pass`): its sources, recv
functions, engine runs and messages. The module docstring of ``_engine`` explains how a pass
runs; ``_plan`` how a run keeps each node to one execution per pass."""

from __future__ import annotations

import itertools
import queue
import threading
import time
from typing import Any

import torch
from torch.autograd.graph import GradientEdge

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
    edge_roots,
    reach_of,
)
from ._grad_messages import (
    BackwardError,
    GradMessage,
    GradUpdate,
    PassMessages,
    done_future,
)
from ._hooks import HookedLeaf
from ._plan import Waiting, add_grads, plan, sharing
from ._run import execute, flush_hooked
from ._sources import Answer as _Answer
from ._sources import Outbox
from ._sources import RecvState as _RecvState
from ._sources import Source as _Source
from ._sources import edges as _edges

__all__ = [
    "ROOT",
    "BackwardError",
    "GradMessage",
    "GradUpdate",
    "Pass",
    "PassMessages",
]

_profiler_enabled: Any = torch.autograd._profiler_enabled  # type: ignore[attr-defined]
ROOT = -1  # the source key of the roots; send functions use their message id

_pass_ids = itertools.count()
_ALL_PASSES: set[Pass] = set()
_PASSES_LOCK = threading.Lock()
_done_future = done_future  # (the engine's name for it)


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
        self.recv_nodes: dict[int, int] = {}  # id(recv node) -> its message id
        #: shared node id -> the number of pending sources that reach it (``_plan``)
        self.blockers: dict[int, int] = {}
        #: gradients at nodes that could not run yet, by (node id, input nr)
        self.waiting: dict[tuple[int, int], Waiting] = {}
        self.outstanding = 0  # first messages sent whose answer has not come yet
        # workers known to take part: those messaged, and those a message came from
        self.in_touch: set[int] = set()
        self.heard_from: set[int] = set()
        #: completed when this worker's part is: the answer to the first message (its value:
        #: the updates for that message's sender, or None)
        self.done: torch.futures.Future[Any] = torch.futures.Future()
        #: the worker whose first message of the pass this worker answers (None: the caller)
        self.parent: int | None = None
        #: the first error an answer brought (set on the I/O thread, before it is processed)
        self.answered_error: BaseException | None = None
        self.finished = False
        #: on the worker that called backward: gradient messages and answers for its thread
        self.driver: queue.SimpleQueue[GradUpdate | _Answer | None] | None = None
        self._keep: list[Reach] = []  # graph node wrappers stay alive while ids are compared
        #: leaves whose gradient meets hooks, by id: they are accumulated once per pass
        self.hooked: dict[int, HookedLeaf] = {}
        #: gradient bytes this worker sent to peers in the pass (the metrics)
        self.grad_bytes = 0
        #: this worker's part of the pass as a span of the pass's trace (calls traced only)
        self.span: _tracing.Span | None = None
        if _tracing.active:
            self.span = _pass_span(pass_id, self.worker_id)
        #: torch older than 2.4 cannot start its engine at a node (``edge_roots``): each
        #: message then runs at once, and a shared node runs once per message
        self.once = edge_roots()
        #: a run of this pass ran nodes with part of their gradient: later runs keep the graph
        self.partial = False
        #: updates for peers, gathered during a step and sent one message per peer
        self._outbox = Outbox()

    # -- joining -------------------------------------------------------------------------------
    def start(self) -> None:
        """Analyse the local graph, tell the known workers, finalise unreachable recvs."""
        ctx = self.ctx
        sends: dict[int, SendRecord] = dict(ctx.send_functions)
        recv_records: dict[int, RecvRecord] = dict(ctx.recv_functions)
        by_node = self.recv_nodes
        for msg_id, record in recv_records.items():
            by_node[id(record.node)] = msg_id
            self.recvs[msg_id] = _RecvState(record)
        reaches: dict[int, Reach] = {k: r.get_reach() for k, r in sends.items()}
        if self.roots is not None:
            reaches[ROOT] = reach_of([root.grad_fn for root in self.roots])
        self._keep.extend(reaches.values())
        for key, reach in reaches.items():
            source = self.sources[key] = _Source(key)
            source.leaves = reach.leaves
            source.accumulators = reach.accumulators
            source.recvs = {by_node[n] for n in reach.recv_nodes if n in by_node}
        if self.roots is not None:
            self.sources[ROOT].roots = tuple(self.roots)
        self.blockers, blocks = sharing(reaches)
        for key, shared_nodes in blocks.items():
            self.sources[key].shared = True
            self.sources[key].blocks = shared_nodes
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

    def run_roots(self) -> None:
        """The roots' run (on the worker that called ``backward``)."""
        assert self.roots is not None
        source = self.sources[ROOT]
        source.grads = [torch.ones_like(root) for root in self.roots]
        source.final_seen = True
        self._advance([source])

    # -- resolution ----------------------------------------------------------------------------
    def on_grad_messages(self, messages: list[GradUpdate]) -> None:
        """Process gradient messages: resolve the sources they complete and run torch's engine
        once for all that this lets run."""
        resolved: list[_Source] = []
        for msg_id, grads, final, total in messages:
            source = self.sources.get(msg_id)
            record: SendRecord | None = self.ctx.send_functions.get(msg_id)
            if source is None or record is None:
                raise BackwardError(
                    f"Could not find send function for autograd message id: {msg_id}"
                )
            if source.resolved:
                continue  # (a duplicate)
            if final:
                source.final_seen = True
                source.expected = total
            if grads is not None:
                source.processed += 1
                if _profiler_enabled():  # the send function's event, as torch's node has
                    with torch.autograd.profiler.record_function(SEND_NAME):
                        pass
                if not source.roots:
                    source.roots = record.get_roots()
                source.add(grads)
                if not self.once:  # (an older torch: every message runs at once)
                    last = source.final_seen and source.processed == source.expected
                    self._run_now(source, last)
            if source.final_seen and source.processed == source.expected:
                resolved.append(source)
        self._advance(resolved)

    def resolve(self, key: int) -> None:
        """Resolve a source that gets no gradient in this pass."""
        source = self.sources[key]
        source.final_seen = True
        self._advance([source])

    def _advance(self, resolved: list[_Source]) -> None:
        """Resolve sources (their nodes are no longer blocked by them), run what that lets
        run, send what the run gives the peers, and check for completion."""
        replan = False
        for source in resolved:
            if source.resolved:
                continue
            source.resolved = True
            if source.blocks:
                replan = True
                blockers = self.blockers
                for node in source.blocks:
                    blockers[node] -= 1
        if not self.once:  # (the roots: a message's gradients ran when it came)
            for source in resolved:
                if source.grads is not None:
                    self._run_now(source, True)
        else:
            fast = [s for s in resolved if s.grads is not None and not s.shared]
            slow = [s for s in resolved if s.grads is not None and s.shared]
            if fast or slow or (replan and self.waiting):
                self._run(fast, slow, replan)
        self._flush_recvs()

    # -- running torch's engine ------------------------------------------------------------------
    def _run(self, fast: list[_Source], slow: list[_Source], replan: bool) -> None:
        """One engine run: from the resolved sources that share no node (as they are), and --
        through a plan -- from the shared ones and the gradients waiting at nodes."""
        roots: list[Any] = []
        grads: list[torch.Tensor] = []
        leaves: dict[int, torch.Tensor] = {}
        accumulators: dict[int, Any] = {}
        recv_ids: set[int] = set()
        for source in fast:
            roots.extend(source.roots)
            grads.extend(source.take())
            leaves.update(source.leaves)
            accumulators.update(source.accumulators)
            recv_ids.update(source.recvs)
        captures: list[tuple[Any, int]] = []
        retain = self.retain_graph
        if slow or replan:
            candidates = self.waiting
            self.waiting = {}
            for source in slow:
                for root, grad in zip(_edges(source.roots), source.take(), strict=True):
                    key = (id(root.node), root.output_nr)
                    waiting = candidates.get(key)
                    if waiting is None:
                        waiting = candidates[key] = Waiting(root.node, root.output_nr)
                    waiting.grad = add_grads(waiting.grad, grad)
            todo = plan(
                [waiting.node for waiting in candidates.values()], self.blockers, self.recv_nodes
            )
            for key, waiting in candidates.items():
                node_id = id(waiting.node)
                if node_id in todo.live:
                    assert waiting.grad is not None
                    roots.append(GradientEdge(waiting.node, waiting.nr))
                    grads.append(waiting.grad)
                elif node_id in todo.later:
                    self.waiting[key] = waiting
            leaves.update(todo.leaves)
            accumulators.update(todo.accumulators)
            recv_ids.update(self.recv_nodes[node] for node in todo.recv_nodes)
            captures = todo.captures
            if todo.partial:  # (see ``_plan._widen``: some nodes run again later)
                self.partial = True
            retain = retain or self.partial
        if roots:
            self._execute(roots, grads, leaves, accumulators, recv_ids, captures, retain)

    def _run_now(self, source: _Source, last: bool) -> None:
        """A message's run on an older torch: at once, keeping the graph unless it is the
        source's last run and it shares no node."""
        retain = self.retain_graph or source.shared or not last
        self._execute(
            list(source.roots),
            source.take(),
            dict(source.leaves),
            source.accumulators,
            set(source.recvs),
            [],
            retain,
        )
        self._send_outbox()

    def _execute(
        self,
        roots: list[Any],
        grads: list[torch.Tensor],
        leaves: dict[int, torch.Tensor],
        accumulators: dict[int, Any],
        recv_ids: set[int],
        captures: list[tuple[Any, int]],
        retain: bool,
    ) -> None:
        """Run torch's engine from ``roots`` (``_run``); queue the recv functions' gradients
        for their peers, keep what flowed into the ``captures`` edges for later runs."""
        recv_list = sorted(recv_ids)
        recv_edges = [self.recvs[msg_id].record.edges for msg_id in recv_list]
        done = execute(
            self.ctx, roots, grads, leaves, accumulators, recv_edges, captures, retain, self.hooked
        )
        if done is None:
            return
        recv_grads, captured = done
        for (node, nr), grad in zip(captures, captured, strict=True):
            if grad is not None:
                key = (id(node), nr)
                waiting = self.waiting.get(key)
                if waiting is None:
                    waiting = self.waiting[key] = Waiting(node, nr)
                waiting.grad = add_grads(waiting.grad, grad)
        for msg_id, captured_recv in zip(recv_list, recv_grads, strict=True):
            state = self.recvs[msg_id]
            self._send_grads(state, state.record.fill(captured_recv))

    # -- messages --------------------------------------------------------------------------------
    def _send_grads(self, state: _RecvState, grads: list[torch.Tensor] | None) -> None:
        """Queue gradients (or, with ``None``, only the final marker) for a recv function;
        :meth:`_send_outbox` sends what a step queued, one message per peer."""
        if grads is not None:
            state.sent += 1
        final = self._recv_ready(state)
        if final:
            state.final = True
        elif grads is None:
            return
        if _profiler_enabled():  # the recv function's event: torch's node sends its gradients
            with torch.autograd.profiler.record_function(RECV_NAME):
                self._queue(state, grads, final)
        else:
            self._queue(state, grads, final)

    def _queue(self, state: _RecvState, grads: list[torch.Tensor] | None, final: bool) -> None:
        record = state.record
        if grads:  # (counted here, inline: reported once, when this part of the pass ends)
            for grad in grads:
                if grad is not None:
                    if grad.layout is _STRIDED:
                        self.grad_bytes += grad.nbytes
                    else:
                        self.grad_bytes += _metrics.tensor_bytes(grad)
        update = GradUpdate(record.msg_id, grads, final, state.sent)
        self._outbox.add(record.src, record.device_map, update)

    def _send_outbox(self) -> None:
        """Send the queued updates: one message per peer (and device map)."""
        if not self._outbox:
            return
        me = (self.ctx.context_id, self.pass_id, self.retain_graph, self.worker_id)
        for worker, device_map, updates in self._outbox.take():
            message = GradMessage(*me, updates)
            self._message(worker, self.messages.grad, (message,), device_map)

    def _recv_ready(self, state: _RecvState) -> bool:
        return all(self.sources[key].resolved for key in state.sources)

    def _flush_recvs(self) -> None:
        """Run the hooks of leaves that are complete; send final markers for recv functions
        whose sources are all resolved."""
        if self.hooked:
            sources = self.sources.values()
            flush_hooked(
                self.ctx,
                self.hooked,
                lambda key: all(s.resolved for s in sources if key in s.leaves),
            )
        for state in self.recvs.values():
            if not state.final and self._recv_ready(state):
                self._send_grads(state, None)
        held = self._hold_for_parent()
        self._send_outbox()
        if held is not None:
            if self._complete():
                # This worker's part is done with this step: the answer to the first message
                # carries what it had for that message's sender (one frame, one wake-up less).
                self._finish()
                self.done.set_result(held)
                return
            self._queue_updates(self.parent, held)
            self._send_outbox()
        self._check_done()

    def _hold_for_parent(self) -> tuple[GradUpdate, ...] | None:
        """The updates queued for the worker whose first message this worker answers (plain
        ones: no device map, no profiler), taken out of the outbox."""
        parent = self.parent
        if parent is None or _profiling.wants(self.messages.grad):
            return None
        return self._outbox.pop(parent)

    def _queue_updates(self, worker: int | None, updates: tuple[GradUpdate, ...]) -> None:
        assert worker is not None
        for update in updates:
            self._outbox.add(worker, None, update)

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
        span = self.span  # its messages are calls of the pass's trace (when traced)
        previous = _tracing.set_current(span) if span is not None else None
        try:
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
        finally:
            if span is not None:
                _tracing.set_current(previous)

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

    def _on_answer(self, result: Any, error: BaseException | None) -> None:
        """The answer to a first message (on the I/O thread: quick, no lock here); it may carry
        the answering worker's last gradient updates for this one (``_flush_recvs``)."""
        updates: tuple[GradUpdate, ...] = result if isinstance(result, tuple) else ()
        if error is not None and self.answered_error is None:
            self.answered_error = error  # (see ``fail_released``)
        driver = self.driver
        if driver is not None:
            for update in updates:
                driver.put(update)
            driver.put(_Answer(error))
            return
        agent = current_agent()
        if agent is not None:
            agent.schedule(lambda: self._answered(error, updates))

    def _answered(self, error: BaseException | None, updates: tuple[GradUpdate, ...]) -> None:
        with self.ctx.lock:
            self.outstanding -= 1
            if error is not None:
                self.fail(error)
            elif updates and not self.finished:
                try:
                    self.on_grad_messages(list(updates))
                except Exception as exc:
                    self.fail(exc)
            else:
                self._check_done()

    # -- completion ------------------------------------------------------------------------------
    def _complete(self) -> bool:
        return (
            not self.finished
            and self.outstanding == 0
            and all(s.resolved for s in self.sources.values())
            and all(r.final for r in self.recvs.values())
        )

    def _check_done(self) -> None:
        if self._complete():
            self._finish()
            self.done.set_result(None)

    def fail_released(self, error: BaseException) -> None:
        """Fail the pass because its context was released under it. That release is often the
        consequence of a peer's failure whose error already came back in an answer not yet
        processed (a worker that lost a peer releases the contexts only it linked it to, and
        tells its own peers): that error, the cause, is the one to report."""
        self.fail(self.answered_error or error)

    def fail(self, error: BaseException) -> None:
        if self.finished:
            return
        self._finish("error")
        detail = str(error) if str(error) else repr(error)
        failure = BackwardError(f"Error on Node {self.worker_id}: {detail}")
        set_future_error(self.done, failure)

    def _finish(self, status: str = "ok") -> None:
        self.finished = True
        if self.grad_bytes:
            _metrics.gradients_sent(self.worker_id, self.grad_bytes)
            self.grad_bytes = 0
        if self.span is not None:
            self.span.end(status)
            self.span = None
        if self.driver is not None:
            self.driver.put(None)  # wake the driving thread
        if self.ctx.pass_state is self:
            self.ctx.pass_state = None
        self.ctx.ended_passes.add(self.pass_id)
        self._keep.clear()
        self.waiting = {}  # (gradients that never ran: a failed pass, or nodes leading nowhere)
        with _PASSES_LOCK:
            _ALL_PASSES.discard(self)

    def waits_on(self, worker: int) -> bool:
        """True if this pass still needs something from ``worker``."""
        for key, source in self.sources.items():
            if key != ROOT and not source.resolved and self.ctx.send_functions[key].dst == worker:
                return True
        return False


_STRIDED = torch.strided


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
