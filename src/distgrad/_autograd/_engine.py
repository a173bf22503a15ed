"""The distributed backward engine.

How a pass runs (see docs/design.md, "Distributed backward pass", for the reasoning):

* **Sources.** On each worker, torch's engine is started from *sources*: the roots (on the
  worker that called ``backward``) and the send functions that receive gradients. Each
  arriving gradient message runs torch's engine at once from its send function (pipelining;
  messages already waiting are batched into one run). Gradients are linear, so running the
  shared parts of the graph once per message gives the same result as one combined run.
* **Recv functions** are never executed: the gradients flowing into them are captured at
  their edges and shipped to the sender as a *partial* message. A recv function is *final*
  once every source that can reach it is resolved; its last message carries ``final`` and
  the number of gradient messages it sent in this pass.
* **Resolution.** A send function is resolved when its peer's final message and all the
  gradient messages it announced have been processed. A recv function no source can reach is
  final at once, with no gradients -- that is how a pass whose RPC results are partly unused
  by the loss finishes (the reference waits forever for gradients that never come).
  Resolution follows the forward's causality backwards, so it always terminates.
* **Start.** A worker joins a pass on the first message of it: a gradient message, or
  ``START``, which a worker sends to the peer of each of its send functions that it has not
  messaged otherwise by the time its joining message (or the roots) was processed -- a peer
  that holds only sinks of this worker's messages would not learn of the pass otherwise.
  Joining needs what each source reaches (leaves, recv functions): the walk below a send
  function is done once, when its message has gone out (``SendRecord.get_reach``), since that
  part of the graph never changes; only the roots are walked when a pass starts.
* **Completion by deferred replies.** The first message a worker receives in a pass is
  answered only when that worker's part is complete (all sources resolved, all recv functions
  final, all its own messages answered); later messages are answered at once. The first
  messages form a tree rooted at the caller of ``backward``, so there is no cycle of waits,
  and ``backward`` returns exactly when the whole pass has finished. No barrier, no polling.
* **Errors** fail the pass where they happen and travel up that tree, each hop prefixing
  ``Error on Node N: ``. The context survives; a new pass supersedes a stale one. A dead
  peer fails every pass that waits on it (through the agent's failure detection).
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from typing import Any, NamedTuple

import torch

from .._errors import DistgradError, RpcTimeoutError, rpc_timeout_message
from .._rpc import _profiling
from .._rpc._agent import current_agent
from .._rpc._functions import async_execution, on_io_thread
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

__all__ = ["BackwardError", "backward", "on_peer_failure"]

_log = logging.getLogger("distgrad.autograd")

ROOT = -1  # the source key of the roots; send functions use their message id
BACKWARD_RANGE = "torch::distributed::autograd::backward"  # torch's profiler range
_profiler_enabled: Any = torch.autograd._profiler_enabled  # type: ignore[attr-defined]
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
    ) -> None:
        self.ctx = ctx
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
                    _start_message,
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
                captured_all = run_engine(outputs, grad_outputs, inputs, retain)
        else:
            captured_all = run_engine(outputs, grad_outputs, inputs, retain)
        hooked_ids = {id(leaf) for leaf in hooked}
        pairs = []
        for leaf, grad in zip(leaf_list, captured_all, strict=False):
            if grad is None:
                continue
            if id(leaf) in hooked_ids:
                pending = self.hooked.get(id(leaf))
                if pending is None:
                    pending = self.hooked[id(leaf)] = HookedLeaf(leaf, accumulators[id(leaf)])
                pending.add(grad)
            else:
                pairs.append((leaf, grad))
        if pairs:
            self.ctx.accumulate_grads(pairs)
        # Sources whose last message this was are resolved *before* the recv gradients go out,
        # so a recv function they finish sends its gradients and "final" in one message.
        for source in finishing:
            source.resolved = True
        position = len(leaf_list)
        for msg_id in recv_list:
            state = self.recvs[msg_id]
            width = len(state.record.edges)
            captured = list(captured_all[position : position + width])
            position += width
            self._send_grads(state, state.record.fill(captured))

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
        update = GradUpdate(record.msg_id, grads, final, state.sent)
        message = GradMessage(
            self.ctx.context_id, self.pass_id, self.retain_graph, self.worker_id, update
        )
        self._message(record.src, _grad_message, (message,))

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

    def _message(self, worker: int, func: Any, args: tuple[Any, ...]) -> None:
        agent = current_agent()
        if agent is None:
            raise BackwardError(
                "RPC has not been initialized. Call torch.distributed.rpc.init_rpc first."
            )
        if _profiling.wants(func):  # a profiled pass: through the agent's profiled calls
            self._message_profiled(agent, worker, func, args)
            return
        if worker in self.heard_from:
            # It already takes part, so this is not its first message: it needs no answer
            # (one would say nothing about the work it causes, which that worker's own part
            # covers, and waiting for it would add a round trip). A one-way message; a failure
            # there fails that worker's part, which reaches the caller of backward through its
            # own first message's answer; a lost peer is reported by the agent.
            assert func is _grad_message  # START goes only to workers not in touch yet
            agent.notify(worker, _late_grad_message, args)
            return
        agent.call_internal(worker, func, args, self._on_answer)
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
        self._finish()
        detail = str(error) if str(error) else repr(error)
        failure = BackwardError(f"Error on Node {self.worker_id}: {detail}")
        self.done.set_exception(failure)  # type: ignore[arg-type]  # torch's stub is too narrow

    def _finish(self) -> None:
        self.finished = True
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


# -- entry points ----------------------------------------------------------------------------------
def _validate_roots(roots: list[torch.Tensor]) -> None:
    if not roots:
        raise RuntimeError("No tensors provided for gradient computation.")
    for root in roots:
        name = getattr(root, "name", None) or ""
        if not root.requires_grad:
            raise RuntimeError("requires_grad not set on root")
        if root.numel() != 1:
            raise RuntimeError(f"{name} is not a scalar, all roots need to be scalar")
        if root.grad_fn is None:
            raise RuntimeError(f"{name} does not have a valid gradient function.")


def backward(context_id: int, roots: list[torch.Tensor], retain_graph: bool = False) -> None:
    """Run the backward pass of ``roots`` across every worker of the context; block until the
    whole pass finished. Gradients accumulate in the context (``get_gradients``). Under a
    profiler, the pass is the range ``torch::distributed::autograd::backward`` as in torch."""
    if _profiler_enabled():
        with torch.autograd.profiler.record_function(BACKWARD_RANGE):
            _backward(context_id, roots, retain_graph)
    else:
        _backward(context_id, roots, retain_graph)


def _backward(context_id: int, roots: list[torch.Tensor], retain_graph: bool) -> None:
    if not isinstance(context_id, int) or not isinstance(roots, (list, tuple)):
        raise TypeError(
            "backward(): incompatible function arguments. The following argument types are "
            "supported: (context_id: int, roots: List[Tensor], retain_graph: bool = False)"
        )
    ctx = CONTAINER.retrieve_context(context_id)
    roots = list(roots)
    _validate_roots(roots)
    with ctx.lock:
        stale = ctx.pass_state
        if stale is not None:
            stale.fail(BackwardError("superseded by a new backward pass"))
        current = Pass(ctx, (CONTAINER.worker_id, next(_pass_ids)), retain_graph, roots)
        current.driver = queue.SimpleQueue()
        ctx.pass_state = current
        try:
            current.start()
            ones = [torch.ones_like(root) for root in roots]
            current.run([EngineRun(ROOT, tuple(roots), ones, True)])
            current.resolve(ROOT)
            current.flood()
        except Exception as exc:
            current.fail(exc)
    # The calling thread drives the rest of its own part: gradient messages for it are queued
    # here rather than run on a pool thread, so the message that completes the pass does not
    # need a second thread to wake this one.
    driver = current.driver
    assert driver is not None
    agent = current_agent()
    bound = agent.rpc_timeout if agent is not None else 0.0
    while not current.finished:
        if current.outstanding == 0 and bound > 0:
            # Every first message is answered, so what is missing can only be a one-way gradient
            # message: wait for it at most the RPC timeout (torch's bound) -- a lost one must
            # fail the pass, naming the peers it waits on, never hang it.
            try:
                first = driver.get(timeout=bound)
            except queue.Empty:
                with ctx.lock:
                    current.fail(_lost_gradients(current, bound))
                break
            items = [first]
        else:
            items = [driver.get()]
        while not driver.empty():  # what is already waiting is handled together
            items.append(driver.get())
        batch = [item for item in items if type(item) is GradUpdate]
        answers = [item for item in items if type(item) is _Answer]
        if not batch and not answers:
            continue
        with ctx.lock:
            if current.finished:
                break
            try:
                if batch:
                    current.on_grad_messages(batch)
                for answer in answers:
                    current.outstanding -= 1
                    if answer.error is not None:
                        current.fail(answer.error)
                        break
                current._check_done()
            except Exception as exc:
                current.fail(exc)
    current.done.wait()


def _lost_gradients(current: Pass, bound: float) -> RpcTimeoutError:
    """The error of a pass whose one-way gradient messages did not all come within ``bound``."""
    agent = current_agent()
    waited = sorted(
        {
            current.ctx.send_functions[key].dst
            for key, source in current.sources.items()
            if key != ROOT and not source.resolved
        }
    )
    names = []
    for worker in waited:
        try:
            assert agent is not None
            names.append(agent.get_worker_info(worker).name)
        except Exception:
            names.append(f"worker id {worker}")
    peers = ", ".join(names) if names else "its peers"
    return RpcTimeoutError(
        f"{rpc_timeout_message(bound)} (the backward pass waited for gradients from {peers})"
    )


def _join(ctx: DistAutogradContext, pass_id: tuple[int, int], retain: bool) -> tuple[Pass, bool]:
    """The pass ``pass_id`` on this worker, joining it if new; True if this message is the first."""
    current: Pass | None = ctx.pass_state
    if current is not None and current.pass_id == pass_id:
        return current, False
    if current is not None:
        current.fail(BackwardError("superseded by a new backward pass"))
    joined = Pass(ctx, pass_id, retain, None)
    ctx.pass_state = joined
    try:
        joined.start()
    except Exception as exc:
        joined.fail(exc)
    return joined, True


def _reply_for(current: Pass, first: bool) -> torch.futures.Future[None]:
    return current.done if first else _done_future()


@async_execution
def _start_message(
    context_id: int, pass_id: tuple[int, int], retain: bool, src: int
) -> torch.futures.Future[None]:
    ctx = CONTAINER.retrieve_context(context_id)
    with ctx.lock:
        if ctx.last_pass_id == pass_id:
            return _done_future()
        current, first = _join(ctx, pass_id, retain)
        current.in_touch.add(src)
        current.heard_from.add(src)
        if first:
            try:
                current.flood()
            except Exception as exc:
                current.fail(exc)
        return _reply_for(current, first)


@async_execution
def _grad_message(message: GradMessage) -> torch.futures.Future[None]:
    context_id, pass_id, retain, src, update = message
    ctx = CONTAINER.retrieve_context(context_id)
    with ctx.lock:
        if ctx.last_pass_id == pass_id:  # a straggler of a pass already over here
            return _done_future()
        current, first = _join(ctx, pass_id, retain)
        current.in_touch.add(src)
        current.heard_from.add(src)
        if current.finished:
            return _reply_for(current, first)
        if current.driver is not None:  # never the first message: answered at once
            current.driver.put(update)
            return _done_future()
        try:
            current.on_grad_messages([update])
            if first:
                current.flood()
        except Exception as exc:
            current.fail(exc)
        return _reply_for(current, first)


@on_io_thread
def _late_grad_message(message: GradMessage) -> None:
    """A gradient message that needs no answer (I/O thread). On the worker that called
    backward it goes straight to the driving thread's queue; elsewhere to a worker thread."""
    ctx = CONTAINER.get_context(message.context_id)
    current = None if ctx is None else ctx.pass_state
    if current is not None and current.pass_id == message.pass_id and current.driver is not None:
        current.in_touch.add(message.src)
        current.heard_from.add(message.src)
        current.driver.put(message.update)
        return
    agent = current_agent()
    if agent is not None:
        agent.schedule(lambda: _grad_message(message))


def on_peer_failure(worker: int, error: Exception) -> None:
    """A peer was lost (the autograd layer's hook): fail the passes that wait on it and
    release the contexts it was this worker's only way to be told about."""
    me = CONTAINER.worker_id  # (agents of an in-memory world share the process and the set)
    with _PASSES_LOCK:
        passes = [p for p in _ALL_PASSES if p.worker_id == me]
    for current in passes:
        with current.ctx.lock:
            if not current.finished and current.waits_on(worker):
                current.fail(error)
    from ._cleanup import release_orphans  # (it imports this module)

    release_orphans(worker)
