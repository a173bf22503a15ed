"""Distributed autograd contexts and the per-process container that owns them (SPEC 2.1, 2.2).

A *context* is one forward/backward of distributed autograd as seen by this worker: the send
and recv functions its RPCs attached, the workers it talked to, and the gradients accumulated
into it (never into ``.grad``). The *container* maps context ids to contexts, hands out ids,
and remembers each thread's *current* context.

Ids (context ids and autograd message ids alike) are ``(worker_id << 48) | counter``, with one
counter per kind that only ever grows: an id never repeats within a process, not even across a
repeated :meth:`ContextContainer.init` with the same worker id (only
:meth:`ContextContainer.reset_for_tests` starts over).

A context's own state is :class:`~._context_state.DistAutogradContext`. This module is
bookkeeping: of RPC it knows only which worker a thread belongs to (in-memory
test worlds run several in one process, see :class:`WorkerContainer`). The engine sets
:data:`on_release` so that leaving a :class:`context` also tells the context's known workers to
release it.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from types import TracebackType

from .._rpc._core import recording, thread_binding
from ._context_state import DistAutogradContext

__all__ = [
    "CONTAINER",
    "ContextContainer",
    "DistAutogradContext",
    "WorkerContainer",
    "context",
    "on_release",
]

MAX_WORKER_ID = 0xFFFF
_ID_BITS = 48
_COUNTER_MAX = (1 << _ID_BITS) - 1

_NOT_INITIALIZED = "Need to initialize distributed autograd using torch.distributed.autograd.init()"
_NO_CURRENT = (
    "Current thread doesn't have a valid autograd context. Please wrap your code using: "
    "`with torch.distributed.autograd.context() as context_id` to generate a valid context"
)


def _not_found(context_id: int) -> RuntimeError:
    return RuntimeError(f"Could not find autograd context with id: {context_id}")


class _ThreadState(threading.local):
    # A class attribute is every thread's default: reading it needs no getattr fallback.
    context_id: int = -1


def _set_current(local: _ThreadState, context_id: int) -> None:
    """Make ``context_id`` (-1: none) the thread's current context in ``local``'s container,
    keeping the thread's count of containers where it has one (``recording.reasons``: the
    call path asks whether to record a call only on a thread where it is above 0)."""
    previous = local.context_id
    local.context_id = context_id
    if previous == -1 and context_id != -1:
        recording.reasons += 1
    elif previous != -1 and context_id == -1:
        recording.reasons -= 1


class ContextContainer:
    """Per-process container of contexts (SPEC 2.2), with id allocation (SPEC 2.1).

    Not usable until :meth:`init` gave it this worker's id; only the thread-local accessors
    and the plain lookups (:meth:`get_context`, :meth:`has_context`,
    :meth:`release_context_if_present`, :meth:`num_contexts`) work before that.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._contexts: dict[int, DistAutogradContext] = {}
        self._local = _ThreadState()
        self._worker_id = -1
        self._prefix = 0
        self._context_counter = itertools.count()
        self._message_counter = itertools.count()

    # -- lifecycle -------------------------------------------------------------------------------
    def init(self, worker_id: int) -> None:
        """Set this worker's id; repeating it with the same id is a no-op."""
        if not 0 <= worker_id <= MAX_WORKER_ID:
            raise RuntimeError(f"worker_id needs to be in the range [0, {MAX_WORKER_ID}]")
        with self._lock:
            if self._worker_id == -1:
                self._worker_id = worker_id
                self._prefix = worker_id << _ID_BITS
            elif self._worker_id != worker_id:
                raise RuntimeError(
                    f"Container is already initialized with worker_id: {self._worker_id}, "
                    f"cannot initialize with different worker_id: {worker_id}"
                )

    def _require_init(self) -> None:
        if self._worker_id == -1:
            raise RuntimeError(_NOT_INITIALIZED)

    @property
    def worker_id(self) -> int:
        """This worker's id (raises before :meth:`init`)."""
        self._require_init()
        return self._worker_id

    @property
    def initialized(self) -> bool:
        """Whether :meth:`init` was called."""
        return self._worker_id != -1

    def reset_for_tests(self) -> None:
        """Forget everything -- contexts, worker id, counters, every thread's current context."""
        with self._lock:
            self._contexts.clear()
            _set_current(self._local, -1)  # (other threads' counts stay high: they ask more)
            self._local = _ThreadState()
            self._worker_id = -1
            self._prefix = 0
            self._context_counter = itertools.count()
            self._message_counter = itertools.count()

    # -- ids -------------------------------------------------------------------------------------
    def _next_id(self, counter: Iterator[int]) -> int:
        value = next(counter)
        if value > _COUNTER_MAX:
            raise RuntimeError(f"Ran out of autograd ids on worker {self._worker_id}")
        return self._prefix | value

    def new_autograd_message_id(self) -> int:
        """A fresh autograd message id (one per wrapped request or response)."""
        self._require_init()
        # next() on itertools.count is atomic: no lock on this per-RPC path.
        return self._next_id(self._message_counter)

    def max_id(self) -> int:
        """The largest id this worker can produce (``_get_max_id()``)."""
        self._require_init()
        return self._prefix | _COUNTER_MAX

    # -- contexts --------------------------------------------------------------------------------
    def new_context(self) -> DistAutogradContext:
        """Create a context and make it this thread's current context."""
        self._require_init()
        local = self._local
        if local.context_id != -1:
            raise RuntimeError("Already have an autograd context id for this thread.")
        with self._lock:
            ctx = DistAutogradContext(self._next_id(self._context_counter))
            self._contexts[ctx.context_id] = ctx
        _set_current(local, ctx.context_id)
        return ctx

    def get_or_create_context(self, context_id: int) -> DistAutogradContext:
        """The context ``context_id``, created if absent (receiver side; current unchanged)."""
        self._require_init()
        with self._lock:
            ctx = self._contexts.get(context_id)
            if ctx is None:
                ctx = self._contexts[context_id] = DistAutogradContext(context_id)
            return ctx

    def retrieve_context(self, context_id: int) -> DistAutogradContext:
        """The context ``context_id``; raises if there is none."""
        self._require_init()
        ctx = self._contexts.get(context_id)
        if ctx is None:
            raise _not_found(context_id)
        return ctx

    def get_context(self, context_id: int) -> DistAutogradContext | None:
        """The context ``context_id``, or None."""
        return self._contexts.get(context_id)

    def has_context(self, context_id: int) -> bool:
        """Whether the context ``context_id`` exists here."""
        return context_id in self._contexts

    def release_context(self, context_id: int) -> DistAutogradContext:
        """Remove the context and return it; raises if there is none.

        Resets this thread's current context if it was this one. Telling the known workers
        is the caller's job (see :data:`on_release`).
        """
        self._require_init()
        ctx = self.release_context_if_present(context_id)
        if ctx is None:
            raise _not_found(context_id)
        return ctx

    def release_context_if_present(self, context_id: int) -> DistAutogradContext | None:
        """Remove the context and return it, or return None if there is none."""
        with self._lock:
            ctx = self._contexts.pop(context_id, None)
        if ctx is not None and self._local.context_id == context_id:
            _set_current(self._local, -1)
        return ctx

    def created_here(self, context_id: int) -> bool:
        """Whether ``context_id`` is one of this worker's own ids (a context its user made)."""
        return self._worker_id != -1 and context_id >> _ID_BITS == self._worker_id

    def num_contexts(self) -> int:
        """How many contexts live on this worker."""
        return len(self._contexts)

    def contexts(self) -> list[DistAutogradContext]:
        """The contexts that live on this worker (a snapshot)."""
        with self._lock:
            return list(self._contexts.values())

    def debug_info(self) -> dict[str, int]:
        """``_get_debug_info()``: exactly the two keys the reference reports."""
        self._require_init()
        with self._lock:
            contexts = list(self._contexts.values())
        return {
            "num_current_backward_passes": sum(c.pass_state is not None for c in contexts),
            "num_autograd_contexts": len(contexts),
        }

    # -- the thread's current context ------------------------------------------------------------
    def current_context(self) -> DistAutogradContext:
        """This thread's current context; raises if there is none."""
        self._require_init()
        context_id = self._local.context_id
        ctx = self._contexts.get(context_id) if context_id != -1 else None
        if ctx is None:
            raise RuntimeError(_NO_CURRENT)
        return ctx

    def current_context_id(self) -> int:
        """This thread's current context id, -1 if none (on every RPC's path: kept cheap)."""
        return self._local.context_id

    def has_current_context(self) -> bool:
        """Whether this thread has a current context."""
        return self._local.context_id != -1

    def set_current_context_id(self, context_id: int) -> None:
        """Make ``context_id`` this thread's current context (it need not exist here)."""
        _set_current(self._local, context_id)

    def clear_current_context(self) -> None:
        """Leave this thread without a current context."""
        _set_current(self._local, -1)

    @contextlib.contextmanager
    def forced_current(self, context_id: int) -> Iterator[None]:
        """Run the block with ``context_id`` as this thread's current context, then restore.

        This is what a callee does while it runs a wrapped request: the user function sees the
        caller's context, and nested RPCs it makes are recorded in it.
        """
        local = self._local
        previous = local.context_id
        _set_current(local, context_id)
        try:
            yield
        finally:
            _set_current(local, previous)


class WorkerContainer:
    """:data:`CONTAINER`: the container of the worker the calling thread belongs to.

    In a process with one agent -- every real run -- that is the process's own container
    (:attr:`process`), whatever the thread. An in-memory test world runs several agents in one
    process; each is *isolated*, and every thread it owns (and each thread the world runs a
    worker's code on) is bound to it (``_rpc._core._agent.bind_thread``): such a thread gets its
    agent's own container, created on first use. The cost where no thread is bound: one
    thread-local read per call."""

    def __init__(self) -> None:
        self.process = ContextContainer()

    def get(self) -> ContextContainer:
        """The calling thread's container."""
        agent = thread_binding.agent
        if agent is None:
            return self.process
        found = agent.layer_state.get(ContextContainer)
        if found is None:
            found = agent.layer_state.setdefault(ContextContainer, ContextContainer())
        assert isinstance(found, ContextContainer)
        return found

    def init(self, worker_id: int) -> None:
        self.get().init(worker_id)

    @property
    def worker_id(self) -> int:
        return self.get().worker_id

    @property
    def initialized(self) -> bool:
        return self.get().initialized

    def reset_for_tests(self) -> None:
        self.get().reset_for_tests()

    def new_autograd_message_id(self) -> int:
        return self.get().new_autograd_message_id()

    def max_id(self) -> int:
        return self.get().max_id()

    def new_context(self) -> DistAutogradContext:
        return self.get().new_context()

    def get_or_create_context(self, context_id: int) -> DistAutogradContext:
        return self.get().get_or_create_context(context_id)

    def retrieve_context(self, context_id: int) -> DistAutogradContext:
        return self.get().retrieve_context(context_id)

    def get_context(self, context_id: int) -> DistAutogradContext | None:
        return self.get().get_context(context_id)

    def has_context(self, context_id: int) -> bool:
        return self.get().has_context(context_id)

    def release_context(self, context_id: int) -> DistAutogradContext:
        return self.get().release_context(context_id)

    def release_context_if_present(self, context_id: int) -> DistAutogradContext | None:
        return self.get().release_context_if_present(context_id)

    def created_here(self, context_id: int) -> bool:
        return self.get().created_here(context_id)

    def num_contexts(self) -> int:
        return self.get().num_contexts()

    def contexts(self) -> list[DistAutogradContext]:
        return self.get().contexts()

    def debug_info(self) -> dict[str, int]:
        return self.get().debug_info()

    def current_context(self) -> DistAutogradContext:
        return self.get().current_context()

    def current_context_id(self) -> int:
        if thread_binding.agent is None:  # (every RPC asks: no call in a process of one agent)
            return self.process._local.context_id  # type: ignore[no-any-return]
        return self.get().current_context_id()

    def has_current_context(self) -> bool:
        return self.get().has_current_context()

    def set_current_context_id(self, context_id: int) -> None:
        self.get().set_current_context_id(context_id)

    def clear_current_context(self) -> None:
        self.get().clear_current_context()

    def forced_current(self, context_id: int) -> AbstractContextManager[None]:
        return self.get().forced_current(context_id)


CONTAINER = WorkerContainer()
"""The container of the calling thread's worker (the process's own, but in test worlds)."""

on_release: Callable[[DistAutogradContext], None] | None = None
"""Called with each context a :class:`context` block released, after its removal (set by the
engine to send the cleanup to the context's known workers)."""


class context:
    """Context object to wrap forward and backward passes when using distributed autograd
    (torch's ``dist_autograd.context``).

    The ``context_id`` generated in the ``with`` statement identifies the distributed backward
    pass on all workers. Inside the block, RPCs are recorded in the context (send and recv
    functions), the workers they reach join it, and functions they run see it as their
    current context. Each worker keeps the metadata and the gradients of the context, and it
    is released on all of them when the block exits (also on an exception, which
    propagates). Ids are ``(worker id << 48) | counter``.

    Returns:
        int: (from ``__enter__``) the new context's id.

    Raises:
        RuntimeError: distributed autograd is not initialized on this worker (call
            ``rpc.init_rpc`` first), or this thread is already in a context ("Already have an
            autograd context id for this thread."): contexts do not nest.

    Example:
        # on worker 0 (worker1 serves)
        import torch
        import distgrad.autograd as dist_autograd
        import distgrad.rpc as rpc

        with dist_autograd.context() as context_id:
            t1 = torch.rand((3, 3), requires_grad=True)
            t2 = torch.rand((3, 3), requires_grad=True)
            loss = rpc.rpc_sync("worker1", torch.add, args=(t1, t2)).sum()
            dist_autograd.backward(context_id, [loss])
    """

    autograd_context: DistAutogradContext

    def __enter__(self) -> int:
        self.autograd_context = CONTAINER.new_context()
        return self.autograd_context._context_id()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        released = CONTAINER.release_context(self.autograd_context._context_id())
        hook = on_release
        if hook is not None:
            hook(released)
