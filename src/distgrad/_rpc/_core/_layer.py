"""The one way a layer above RPC plugs into it: an :class:`RpcLayer`, registered once with
:func:`register_layer`.

The RPC layer never imports the layers above it (distributed autograd, the profiler); they
subclass :class:`RpcLayer`, override the hooks they need (the others are no-ops) and register
an instance when their public module is imported. Registration is idempotent (a layer of the
same name replaces the old one in place) and keeps its order: lifecycle hooks run in it.

A layer plays up to two *roles* on the call path, each held by at most one layer:

* **records calls** (:attr:`RpcLayer.records_calls`, distributed autograd): it sees the
  tensors of every message and returns a :class:`CallRecord` that travels in the message's
  tensor table; on the receiving side it sees the record and the tensors *before* the payload
  is built around them and may substitute them; it runs the callee's function in a scope, and
  runs ``RRef.backward(context_id)`` on the owner;
* **profiles calls** (:attr:`RpcLayer.profiles_calls`, ``distgrad.profiler``): while torch's
  profiler is on, it makes the call itself through the agent and serves the callee's side
  (see ``_profiling``);
* **tracks references** (:attr:`RpcLayer.tracks_references`, RRefs, ``_rrefs._layer``): it
  collects the references unpickled with a request, the agent runs the request's function only
  once they are usable, and a request that fails before its function runs may be answered by
  it (a ``remote()`` creation's error becomes the value's).

Layers see the agent through :class:`LayerAgent`, the little of it that every agent offers
them; a layer that needs more (RRefs) is above the agent and may import it.

When no layer holds a role, the call path pays one ``None`` check for it. Lifecycle hooks --
:meth:`~RpcLayer.on_agent_start`, :meth:`~RpcLayer.on_peer_failure`,
:meth:`~RpcLayer.on_shutdown`, :meth:`~RpcLayer.on_agent_stop` -- run for every layer, in
registration order. A layer that raises in ``on_agent_start`` or ``on_shutdown`` fails the
start or the shutdown with a ``RuntimeError`` naming it (the cause chained); one that raises in
``on_peer_failure`` or ``on_agent_stop`` is logged and the other layers still run. Exceptions
from the call-path hooks are the call's: the call fails with them, as it would if the function
had raised.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any, ClassVar, NamedTuple, Protocol

import torch

from . import _current
from ._messages import register_message_type
from ._worker_info import WorkerInfo

__all__ = [
    "CallRecord",
    "KeyScope",
    "LayerAgent",
    "RpcLayer",
    "call_profiler",
    "call_recorder",
    "layer_metrics",
    "layers",
    "recording",
    "register_layer",
    "shutting_down",
    "unregister_layer",
]

_log = logging.getLogger(__name__)

#: What a profiled call sends through: the agent's ``call_sync`` or ``call_async``.
SendSync = Callable[..., object]
SendAsync = Callable[..., "torch.futures.Future[object]"]


class CallRecord(NamedTuple):
    """A message's ``ext``: what the call-recording layer attaches to it (distributed
    autograd: the context the call belongs to, the message's autograd id, the sending
    worker, and -- for a request where this worker has a device map to the callee -- that
    map, as torch's ``sendMessageWithAutograd`` embeds it: the callee's recv function keeps
    its inverse and sends the gradients back by it)."""

    context_id: int
    message_id: int
    from_worker: int
    device_map: dict[torch.device, torch.device] | None = None


class LayerAgent(Protocol):
    """What a layer's lifecycle hooks may use of the agent they are given (``_agent.RpcAgent``
    is one; the RPC core hands its layers nothing more, so this module needs no import of it)."""

    @property
    def worker_info(self) -> WorkerInfo: ...

    @property
    def layer_state(self) -> dict[object, object]:
        """Per-agent state of the layers above, keyed by each layer's own key."""
        ...


class KeyScope(AbstractContextManager["KeyScope"]):
    """What :meth:`RpcLayer.key_scope` returns; this base class is the no-op used when not
    profiling (see ``_profiling``)."""

    def end_on(self, future: torch.futures.Future[Any]) -> None:
        """End the scope's range when ``future`` completes instead of at block exit."""

    def __exit__(self, *exc: object) -> None:
        return None


class RpcLayer:
    """A layer above RPC. Subclasses set :attr:`name`, override the hooks they need and
    claim a role by setting :attr:`records_calls` or :attr:`profiles_calls`."""

    #: Unique among the registered layers; used in errors and logs.
    name: ClassVar[str] = "layer"
    #: This layer records calls (the ``*_request`` / ``*_response`` / ``scope`` / ``sent`` /
    #: ``backward`` hooks are called).
    records_calls: ClassVar[bool] = False
    #: This layer profiles calls (the ``call_*`` / ``serve*`` / ``key_scope`` hooks are called).
    profiles_calls: ClassVar[bool] = False
    #: This layer tracks references (the ``*_collecting`` / ``wait_usable`` / ``fail_unrun``
    #: hooks are called).
    tracks_references: ClassVar[bool] = False
    #: A layer that records calls and keeps :data:`recording` up to date: the call path then
    #: asks :meth:`active` only on threads whose count is above 0.
    counts_recording: ClassVar[bool] = False

    # -- lifecycle (every layer) -----------------------------------------------------------------
    def message_types(self) -> Mapping[object, str]:
        """The functions this layer's messages call, with torch's message type name for each
        (what the fault injector and the profiler see). Registered with the layer."""
        return {}

    def on_agent_start(self, agent: LayerAgent) -> None:
        """An agent is starting (before it listens), on a thread bound to it; also called for
        the running agent when the layer is registered after ``init_rpc``."""

    def on_peer_failure(self, agent: LayerAgent, worker: int, error: Exception) -> None:
        """Callback pool: ``worker`` died or left; ``error`` is what waits on it fail with."""

    def on_shutdown(self, agent: LayerAgent) -> None:
        """A graceful ``shutdown()``: every worker reached it; RRef users are deleted next."""

    def on_agent_stop(self, agent: LayerAgent) -> None:
        """The agent stopped (gracefully or not): its threads ended, every call failed."""

    def metrics(self, agent: LayerAgent) -> Mapping[str, float]:
        """Any thread, ``agent`` bound to it: this layer's figures for the agent's metrics
        (each exposed as ``distgrad_<name>``: see docs/observability.md); quick, no RPC."""
        return {}

    # -- records calls -------------------------------------------------------------------------
    # A callee's *state* for a request is the id of the context its function runs in
    # (``None``: the request needs nothing).
    def active(self) -> bool:
        """Caller thread: whether outgoing requests need recording at all now (when not, the
        message is pickled in one pass, its tensors inline). With :attr:`counts_recording`,
        asked only on a thread whose :data:`recording` count is above 0."""
        return False

    def outgoing_request(
        self, dst: int, tensors: list[torch.Tensor], force: bool
    ) -> CallRecord | None:
        """Caller thread, before sending a request: its record (``None`` for none); ``force``:
        record it even without tensors that require grad."""
        return None

    def incoming_request(
        self, src: int, ext: CallRecord | None, tensors: list[torch.Tensor]
    ) -> tuple[list[torch.Tensor], int | None]:
        """Callee: the tensors to build the payload with, and a state for running the call."""
        return tensors, None

    def scope(self, state: int) -> AbstractContextManager[None]:
        """Callee: the context in which the user function runs."""
        return nullcontext()

    def outgoing_response(
        self, state: int, dst: int, tensors: list[torch.Tensor]
    ) -> CallRecord | None:
        """Callee, before sending the response of a request that had a state: its record."""
        return None

    def incoming_response(
        self, src: int, ext: CallRecord | None, tensors: list[torch.Tensor]
    ) -> list[torch.Tensor]:
        """Caller, on a response with a tensor table: the tensors to build the result with."""
        return tensors

    def sent(self) -> None:
        """Sending thread, right after it wrote (or failed to write) a recorded request or
        response: time for work deferred from the send."""

    def backward(self, context_id: int, roots: list[torch.Tensor], retain_graph: bool) -> None:
        """``RRef.backward(context_id)`` on the owner: the distributed backward pass."""
        raise RuntimeError(f"RPC layer {self.name!r} cannot run a distributed backward pass")

    # -- tracks references ----------------------------------------------------------------------
    def start_collecting(self) -> object:
        """Worker thread, before a request is unpickled: collect the references it carries
        from now on; returns what :meth:`stop_collecting` restores."""
        return None

    def stop_collecting(self, previous: object) -> list[Any]:
        """Worker thread, after the request was unpickled (or failed to be): the references
        collected since :meth:`start_collecting` that are not usable yet."""
        return []

    def wait_usable(self, collected: list[Any], timeout: float | None) -> None:
        """Worker thread (its pool slot freed): wait until ``collected`` are usable, or raise
        why they never will be (an ``RpcTimeoutError`` after ``timeout`` seconds)."""

    def fail_unrun(self, agent: LayerAgent, error: BaseException) -> bool:
        """Worker thread: the request being served failed with ``error`` before its function
        ran. True if the layer took the error (the request is then answered, not failed)."""
        return False

    # -- profiles calls ------------------------------------------------------------------------
    def call_sync(
        self,
        send: SendSync,
        me: WorkerInfo,
        dst: WorkerInfo,
        func: object,
        args: tuple[object, ...],
        kwargs: dict[str, object],
        timeout: float,
        force: bool,
        internal: bool,
    ) -> object:
        """Caller thread: make the call through ``send`` (the agent's ``call_sync``), profiled."""
        return send(dst, func, args, kwargs, timeout, force=force, internal=internal)

    def call_async(
        self,
        send: SendAsync,
        me: WorkerInfo,
        dst: WorkerInfo,
        func: object,
        args: tuple[object, ...],
        kwargs: dict[str, object],
        timeout: float,
        force: bool,
        internal: bool,
    ) -> torch.futures.Future[object]:
        """Caller thread: as :meth:`call_sync`, through the agent's ``call_async``."""
        return send(dst, func, args, kwargs, timeout, force=force, internal=internal)

    def serve(
        self,
        request: tuple[bool, bool],
        func: Callable[..., object],
        args: tuple[object, ...],
        kwargs: dict[str, object] | None,
    ) -> object:
        """Callee: run ``func`` profiled; return ``(result, remote profile)``."""
        raise RuntimeError(f"RPC layer {self.name!r} does not profile calls")

    def serve_async(
        self,
        request: tuple[bool, bool],
        func: Callable[..., object],
        args: tuple[object, ...],
        kwargs: dict[str, object] | None,
    ) -> torch.futures.Future[object]:
        """Callee: as :meth:`serve` for an ``@async_execution`` function."""
        raise RuntimeError(f"RPC layer {self.name!r} does not profile calls")

    def key_scope(self, kind: str, func: object, me: WorkerInfo, dst: WorkerInfo) -> KeyScope:
        """Caller thread: a range named for ``kind`` that the next call on this thread uses."""
        raise RuntimeError(f"RPC layer {self.name!r} does not profile calls")

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"


class _Recording(threading.local):
    #: the reasons the layer that records calls has to be asked on this thread whether to
    #: record (:meth:`RpcLayer.active`), where it keeps the count
    #: (:attr:`RpcLayer.counts_recording`; distributed autograd: the containers where this
    #: thread has a current context): a thread where it is 0 -- any thread outside a context
    #: -- is not asked, an attribute read on the call path instead of a call
    reasons: int = 0


#: per thread: whether calls made on it may need recording (see :class:`_Recording`)
recording = _Recording()
#: whether the layer that records calls (if any) keeps :data:`recording`
recorder_counts = False


# -- the registry ------------------------------------------------------------------------------
# Read on the call path without a lock (a reference read is atomic); written under _lock.
_lock = threading.Lock()
_layers: tuple[RpcLayer, ...] = ()
_recorder: RpcLayer | None = None
_profiler: RpcLayer | None = None
_references: RpcLayer | None = None


def _holder(role: str, candidates: tuple[RpcLayer, ...]) -> RpcLayer | None:
    holders = [layer for layer in candidates if getattr(layer, role)]
    if len(holders) > 1:
        names = ", ".join(repr(layer.name) for layer in holders)
        raise ValueError(f"only one RPC layer may have {role}; layers {names} both claim it")
    return holders[0] if holders else None


def _install(new: tuple[RpcLayer, ...]) -> None:
    global _layers, _recorder, _profiler, _references, recorder_counts
    recorder = _holder("records_calls", new)
    profiler = _holder("profiles_calls", new)
    references = _holder("tracks_references", new)
    recorder_counts = recorder is not None and recorder.counts_recording
    _layers, _recorder, _profiler, _references = new, recorder, profiler, references


def register_layer(layer: RpcLayer) -> None:
    """Plug ``layer`` into the RPC layer (idempotent). A layer of the same :attr:`~RpcLayer.name`
    is replaced in place; a new one goes last. If an agent is running, the layer is started
    for it at once (:meth:`RpcLayer.on_agent_start`).

    Raises:
        TypeError: ``layer`` is not an :class:`RpcLayer`.
        ValueError: another layer already holds a role ``layer`` claims.
    """
    if not isinstance(layer, RpcLayer):
        raise TypeError(f"an RPC layer must be an RpcLayer, not {type(layer).__name__}")
    with _lock:
        if layer in _layers:
            return
        names = [existing.name for existing in _layers]
        if layer.name in names:
            at = names.index(layer.name)
            new = (*_layers[:at], layer, *_layers[at + 1 :])
        else:
            new = (*_layers, layer)
        _install(new)
        for func, type_name in layer.message_types().items():
            register_message_type(func, type_name)
    agent: LayerAgent | None = _current.current()
    if agent is not None:
        _start(layer, agent)


def unregister_layer(name: str) -> RpcLayer | None:
    """Remove the layer called ``name`` (tests); return it, or ``None`` if none was."""
    with _lock:
        found = [layer for layer in _layers if layer.name == name]
        if not found:
            return None
        _install(tuple(layer for layer in _layers if layer.name != name))
    return found[0]


def layers() -> tuple[RpcLayer, ...]:
    """The registered layers, in registration order."""
    return _layers


def call_recorder() -> RpcLayer | None:
    """The layer that records calls, if any (one read on the call path)."""
    return _recorder


def call_profiler() -> RpcLayer | None:
    """The layer that profiles calls, if any."""
    return _profiler


def reference_tracker() -> RpcLayer | None:
    """The layer that tracks references, if any."""
    return _references


# -- lifecycle dispatch (the agent and the public API call these) ---------------------------------
def _start(layer: RpcLayer, agent: LayerAgent) -> None:
    try:
        layer.on_agent_start(agent)
    except Exception as exc:
        raise RuntimeError(
            f"RPC layer {layer.name!r} failed to start for {agent.worker_info.name}: {exc!r}"
        ) from exc


def agent_starting(agent: LayerAgent) -> None:
    """Every layer's :meth:`~RpcLayer.on_agent_start`, in order."""
    for layer in _layers:
        _start(layer, agent)


def peer_failed(agent: LayerAgent, worker: int, error: Exception) -> None:
    """Every layer's :meth:`~RpcLayer.on_peer_failure`; one that raises is logged."""
    for layer in _layers:
        try:
            layer.on_peer_failure(agent, worker, error)
        except Exception:
            _log.exception("RPC layer %r failed on the failure of worker %d", layer.name, worker)


def shutting_down(agent: LayerAgent) -> None:
    """Every layer's :meth:`~RpcLayer.on_shutdown`, in order (a graceful shutdown)."""
    for layer in _layers:
        try:
            layer.on_shutdown(agent)
        except Exception as exc:
            raise RuntimeError(f"RPC layer {layer.name!r} failed to shut down: {exc!r}") from exc


def agent_stopped(agent: LayerAgent) -> None:
    """Every layer's :meth:`~RpcLayer.on_agent_stop`; one that raises is logged."""
    for layer in _layers:
        try:
            layer.on_agent_stop(agent)
        except Exception:
            _log.exception("RPC layer %r failed when %s stopped", layer.name, agent.worker_info)


def layer_metrics(agent: LayerAgent) -> dict[str, float]:
    """Every layer's :meth:`~RpcLayer.metrics` for ``agent``; one that raises is logged."""
    figures: dict[str, float] = {}
    for layer in _layers:
        try:
            figures.update(layer.metrics(agent))
        except Exception:
            _log.debug("RPC layer %r failed to report its metrics", layer.name, exc_info=True)
    return figures
