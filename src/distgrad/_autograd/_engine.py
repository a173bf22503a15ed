"""The distributed backward engine: ``backward``, and the handlers of the messages of a pass
(the state of one pass on one worker is a :class:`~._pass.Pass`).

How a pass runs (see docs/design.md, "Distributed backward pass", for the reasoning):

* **Sources.** On each worker, torch's engine is started from *sources*: the roots (on the
  worker that called ``backward``) and the send functions that receive gradients. A source's
  gradients are summed until it is *resolved*; then one run starts from it (with others
  resolved at the same time, and gradients waiting at nodes). Each node of the worker's graph
  runs at most once per pass, with the sum of its gradients, as in torch: a run executes only
  the nodes no pending source reaches, and what flows into the others waits there (``_plan``).
  Sources that share no node with another run as they are. Everything a run sends a peer goes
  in one message.
* **Recv functions** are never executed: the gradients flowing into them are captured at
  their edges and shipped to the sender. A recv function is *final* once every source that
  can reach it is resolved (its gradient is captured in that same run, so one message carries
  both); the message carries ``final`` and the number of gradient messages it sent.
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
  peer fails every pass that waits on it (through the agent's failure detection). Late
  messages of a pass that is over (or superseded, or whose context is gone) are dropped with
  a debug line.
"""

from __future__ import annotations

import logging
import queue
import time
from typing import Any

import torch

from .._errors import RpcTimeoutError, rpc_timeout_message
from .._rpc._core import async_execution, current_agent, on_io_thread
from . import _metrics
from ._cleanup import release_orphans
from ._context import CONTAINER, DistAutogradContext
from ._grad_messages import BackwardError, GradMessage, GradUpdate, PassMessages
from ._grad_messages import done_future as _done_future
from ._pass import _ALL_PASSES, _PASSES_LOCK, ROOT, Pass, _pass_ids
from ._sources import Answer as _Answer

__all__ = ["BackwardError", "backward", "on_peer_failure"]

_log = logging.getLogger("distgrad.autograd")

BACKWARD_RANGE = "torch::distributed::autograd::backward"  # torch's profiler range
_profiler_enabled: Any = torch.autograd._profiler_enabled  # type: ignore[attr-defined]


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
    started = time.perf_counter()
    ctx = CONTAINER.retrieve_context(context_id)
    roots = list(roots)
    _validate_roots(roots)
    with ctx.lock:
        stale = ctx.pass_state
        if stale is not None:
            stale.fail(BackwardError("superseded by a new backward pass"))
        pass_id = (CONTAINER.worker_id, next(_pass_ids))
        current = Pass(ctx, pass_id, retain_graph, roots, _MESSAGES)
        current.driver = queue.SimpleQueue()
        ctx.pass_state = current
        try:
            current.start()
            current.run_roots()
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
    try:
        current.done.wait()
    except BaseException:
        _metrics.pass_ended(current.worker_id, time.perf_counter() - started, failed=True)
        raise
    _metrics.pass_ended(current.worker_id, time.perf_counter() - started, failed=False)


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


def _stale(ctx: DistAutogradContext, pass_id: tuple[int, int]) -> bool:
    """True for a pass that is over here or that a later pass of its caller superseded: its
    late messages are dropped (quietly: a failed pass's stragglers are no error)."""
    if pass_id in ctx.ended_passes:
        return True
    current: Pass | None = ctx.pass_state
    return (
        current is not None and current.pass_id[0] == pass_id[0] and pass_id[1] < current.pass_id[1]
    )


def _join(
    ctx: DistAutogradContext, pass_id: tuple[int, int], retain: bool, src: int
) -> tuple[Pass, bool]:
    """The pass ``pass_id`` on this worker, joining it if new (``src``'s message is then its
    first, answered when this worker's part is done); True if this message is the first."""
    current: Pass | None = ctx.pass_state
    if current is not None and current.pass_id == pass_id:
        return current, False
    if current is not None:
        current.fail(BackwardError("superseded by a new backward pass"))
    joined = Pass(ctx, pass_id, retain, None, _MESSAGES)
    joined.parent = src
    ctx.pass_state = joined
    try:
        joined.start()
    except Exception as exc:
        joined.fail(exc)
    return joined, True


def _reply_for(current: Pass, first: bool) -> torch.futures.Future[Any]:
    return current.done if first else _done_future()


@async_execution
def _start_message(
    context_id: int, pass_id: tuple[int, int], retain: bool, src: int
) -> torch.futures.Future[Any]:
    ctx = CONTAINER.retrieve_context(context_id)
    with ctx.lock:
        if _stale(ctx, pass_id):
            return _done_future()
        current, first = _join(ctx, pass_id, retain, src)
        current.in_touch.add(src)
        current.heard_from.add(src)
        if first:
            try:
                current.flood()
            except Exception as exc:
                current.fail(exc)
        return _reply_for(current, first)


@async_execution
def _grad_message(message: GradMessage) -> torch.futures.Future[Any]:
    context_id, pass_id, retain, src, updates = message
    ctx = CONTAINER.retrieve_context(context_id)
    with ctx.lock:
        if _stale(ctx, pass_id):  # a straggler of a pass already over here
            _log.debug("dropped a gradient message of pass %s (over here)", pass_id)
            return _done_future()
        current, first = _join(ctx, pass_id, retain, src)
        current.in_touch.add(src)
        current.heard_from.add(src)
        if current.finished:
            return _reply_for(current, first)
        if current.driver is not None:  # never the first message: answered at once
            for update in updates:
                current.driver.put(update)
            return _done_future()
        try:
            current.on_grad_messages(list(updates))
            if first:
                current.flood()
        except Exception as exc:
            current.fail(exc)
        return _reply_for(current, first)


def _late(message: GradMessage) -> None:
    """A one-way gradient message on a worker thread: nothing waits for an answer, so one
    that finds no context (its pass failed and the context is gone) is dropped quietly."""
    if CONTAINER.get_context(message.context_id) is None:
        _log.debug("dropped a gradient message for context %s (gone)", message.context_id)
        return
    try:
        _grad_message(message)
    except Exception as exc:  # (the context went away in between)
        _log.debug("dropped a gradient message for context %s: %s", message.context_id, exc)


@on_io_thread
def _late_grad_message(message: GradMessage) -> None:
    """A gradient message that needs no answer (I/O thread). On the worker that called
    backward it goes straight to the driving thread's queue; elsewhere to a worker thread."""
    ctx = CONTAINER.get_context(message.context_id)
    if ctx is None:
        _log.debug("dropped a gradient message for context %s (gone)", message.context_id)
        return
    current = ctx.pass_state
    if current is not None and current.pass_id == message.pass_id and current.driver is not None:
        current.in_touch.add(message.src)
        current.heard_from.add(message.src)
        for update in message.updates:
            current.driver.put(update)
        return
    agent = current_agent()
    if agent is not None:
        agent.schedule(lambda: _late(message))


#: what every pass sends its peers (``_pass`` is below this module: it is handed them)
_MESSAGES = PassMessages(start=_start_message, grad=_grad_message, late_grad=_late_grad_message)


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
    release_orphans(worker)
