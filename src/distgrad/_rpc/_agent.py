"""The RPC agent: requests out, requests in, responses, timeouts, peer failure, shutdown.

Threads, and what runs where:

* the **caller's thread** pickles a request and writes it straight to the socket (no hop);
  ``rpc_sync`` then sleeps on a lock and unpickles the response itself;
* the **I/O thread** reads frames; a response is matched to its call and handed back to the
  waiting caller (or, for ``rpc_async``, to the callback pool); a request goes to the worker
  pool; it also fires timeouts and heartbeats;
* the **worker pool** (``num_worker_threads``, elastic) unpickles requests, runs user
  functions and writes their responses; nested RPCs from a user function just block that one
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
``_extension``: distributed autograd attaches its metadata there).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import pickle
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .. import _config
from .._errors import (
    DistgradError,
    InjectedFailureError,
    MessageTooLargeError,
    PeerFailureError,
    RpcShutdownError,
    RpcTimeoutError,
    rpc_timeout_message,
)
from .._omp import join_openmp_runtime
from .._transport._base import (
    Link,
    MessageInfo,
    PeerAddress,
    Transport,
    TransportConfig,
    TransportFactory,
    TransportStatistics,
)
from .._transport._io import IoThread
from .._wire._frames import Frame, Kind
from .._wire._pickler import Encoded, decode, dumps, encode, loads
from . import _extension, _profiling
from ._calls import RpcFuture, _Call, check_async_result, is_builtin, set_future_error
from ._events import MembershipEvent, MembershipKind
from ._messages import describe_request, describe_response
from ._options import TensorPipeRpcBackendOptions
from ._pool import ThreadPool
from ._remote_error import error_payload, exception_from_payload, report_udf_error
from ._rref_context import RRefContext
from ._torchscript import is_script_function
from ._worker_info import WorkerInfo

__all__ = ["RpcAgent", "bind_thread", "current_agent", "set_current_agent", "thread_binding"]

_log = logging.getLogger("distgrad.rpc")
_TICK = 0.02  # resolution of rpc_async timeouts, seconds
_RETRY_ATTEMPTS = 5  # of idempotent internal messages (torch's RpcRetryOptions: 5)
_RETRY_BACKOFF = 0.05  # seconds before the first retry; doubles each time

_CPU_ONLY = (
    "TensorPipe RPC backend only supports CPU tensors by default, please move your tensors to "
    "CPU before sending them over RPC, or call `set_device_map` on "
    "`TensorPipeRpcBackendOptions` to explicitly configure device mapping. "
)
_UDF_MISSING = (
    "Default RPC pickler does not serialize function code. Ensure that UDFs are defined on "
    "both caller and callee modules."
)


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
        self.worker_info = WorkerInfo(name, rank)
        self.pid = os.getpid()  # the process whose threads these are (not a forked child)
        self.world_size = world_size
        #: members join and leave (``init_rpc(world_size=None)``)
        self.dynamic = dynamic
        #: the random id of this start of the agent (presented in every handshake)
        self.incarnation = int.from_bytes(os.urandom(8), "little") or 1
        self._incarnation_of: dict[int, int] = {rank: self.incarnation}
        #: members that left the group (by name), for errors that name them as departed
        self.departed: dict[str, WorkerInfo] = {}
        #: called (on a callback thread) with every :class:`MembershipEvent`
        self.membership_listeners: list[Callable[[MembershipEvent], None]] = []
        self.options = options
        self.rpc_timeout = options.rpc_timeout
        self.isolated = isolated
        bind = self._bind_thread if isolated else None
        #: per-worker state of the layers above, for isolated agents (keyed by the layer's key)
        self.layer_state: dict[object, object] = {}
        self._io = IoThread(on_start=bind)
        self._transport_factory = transport
        self._transport: Transport | None = None
        self._describe = False  # whether the transport wants a MessageInfo with each frame
        self.address: PeerAddress | None = None
        self._by_name: dict[str, WorkerInfo] = {name: self.worker_info}
        self._by_rank: dict[int, WorkerInfo] = {rank: self.worker_info}
        self._calls: dict[int, _Call] = {}
        self._ids = itertools.count(1)
        self._active = 0
        self._active_lock = threading.Lock()
        self._serving_async = 0  # @async_execution requests whose future is pending
        self._wheel: dict[int, set[int]] = {}
        self._wheel_lock = threading.Lock()
        self._ticking = False
        self._workers = ThreadPool("distgrad-worker", options.num_worker_threads, on_start=bind)
        self._callbacks = ThreadPool("distgrad-callback", options.num_worker_threads, on_start=bind)
        self._pools = (self._workers, self._callbacks)
        self._running = False
        self._stopped = False
        self.keepalive: list[Any] = []  # objects that must live as long as the agent (store)
        self.shutdown_hooks: list[Callable[[], None]] = []
        #: called (on a callback thread) with the rank and error of every peer found dead
        self.peer_failure_listeners: list[Callable[[int, Exception], None]] = []
        self.rrefs = RRefContext(self)
        self._device_checks: dict[tuple[str, int], Callable[[torch.Tensor], torch.Tensor]] = {}
        self._peer_limits: dict[int, int] = {}  # peers accepting less than this worker
        self.rref_leaks: list[Any] = []  # forks still registered when the agent stopped

    def _bind_thread(self) -> None:
        bind_thread(self)

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
        self._io.start()
        self._io.call_soon(join_openmp_runtime)
        self._transport = self._transport_factory(config, self._io, self, self._label)
        self._describe = self._transport.wants_message_info
        self.address = self._transport.listen(listen_host)
        return self.address

    def set_peers(self, workers: list[WorkerInfo], addresses: dict[int, PeerAddress]) -> None:
        for info in workers:
            self._by_name[info.name] = info
            self._by_rank[info.id] = info
        for rank, address in addresses.items():
            if address.incarnation:
                self._incarnation_of[rank] = address.incarnation
        assert self._transport is not None
        self._transport.set_peers(addresses)
        self._peer_limits = {
            rank: address.max_message_size
            for rank, address in addresses.items()
            if 0 < address.max_message_size < self.options.max_message_size
        }
        self._running = True

    # -- membership (dynamic groups) -------------------------------------------------------------
    def incarnation_of(self, rank: int) -> int:
        """The incarnation known for the member of ``rank`` (0: none known)."""
        return self._incarnation_of.get(rank, 0)

    def add_member(self, info: WorkerInfo, address: PeerAddress) -> None:
        """A member joined (or rejoined under its name: a new incarnation)."""
        old = self._by_rank.get(info.id)
        known = self._incarnation_of.get(info.id, 0)
        if old is not None and old.name != info.name:
            self._by_name.pop(old.name, None)
        self._by_name[info.name] = info
        self._by_rank[info.id] = info
        self.departed.pop(info.name, None)
        self._incarnation_of[info.id] = address.incarnation
        if 0 < address.max_message_size < self.options.max_message_size:
            self._peer_limits[info.id] = address.max_message_size
        else:
            self._peer_limits.pop(info.id, None)
        self.transport.add_peer(info.id, address)
        if old is not None and known and known != address.incarnation:
            self._membership_event("restarted", info, known)
        self._membership_event("joined", info, address.incarnation)

    def remove_member(self, rank: int, incarnation: int, reason: str = "it shut down") -> None:
        """The member of ``rank`` left the group (a graceful shutdown, or ``reason``): later
        calls to it fail at once naming it as departed; contexts it took part in are failed
        and cleaned."""
        info = self._by_rank.get(rank)
        if info is None or info == self.worker_info:
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
        for listener in list(self.peer_failure_listeners):
            self._callbacks.submit(listener, rank, error)
        self._membership_event("left", info, incarnation)

    def _membership_event(self, kind: MembershipKind, info: WorkerInfo, incarnation: int) -> None:
        event = MembershipEvent(kind, info, incarnation, time.time())
        _log.info("membership: %s", event)
        for listener in list(self.membership_listeners):
            self._callbacks.submit(listener, event)

    def members(self) -> list[WorkerInfo]:
        """The current members (this worker included), by rank."""
        return self.get_worker_infos()

    def _label(self, rank: int) -> str:
        info = self._by_rank.get(rank)
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
            raise RuntimeError(
                f"name:{self.worker_info.name},rank:{self.worker_info.id} "
                f"could not find destination id {to}"
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
        return {
            "agent.server_active_async_calls": str(self._serving_async),
            "agent.client_active_calls": str(self._active),
            "agent.server_active_calls": str(busy),
            "agent.num_idle_threads": str(max(0, pool.max_threads - busy)),
            "agent.thread_pool_size": str(pool.max_threads),
        }

    def get_debug_info(self) -> dict[str, str]:
        """torch's ``RpcAgent.get_debug_info()``: the metrics of :meth:`get_metrics`."""
        return self.get_metrics()

    @property
    def transport(self) -> Transport:
        assert self._transport is not None
        return self._transport

    def statistics(self) -> TransportStatistics:
        return self.transport.statistics()

    # -- sending ---------------------------------------------------------------------------------
    def _effective_timeout(self, timeout: float) -> float:
        return self.rpc_timeout if timeout < 0 else timeout

    def _stopped_error(self, kind: str) -> RpcShutdownError:
        return RpcShutdownError(
            f"Node {self.worker_info.id}tried to send() a message of type {kind} "
            "but RPC is no longer running on this node."
        )

    def _send(
        self,
        dst: WorkerInfo,
        payload: tuple[Any, ...],
        timeout: float,
        future: torch.futures.Future[Any] | None,
        internal: bool,
        force: bool,
        callback: Callable[[Any, BaseException | None], None] | None = None,
    ) -> tuple[int, _Call]:
        if self._stopped:
            raise self._stopped_error("REQUEST")
        assert self._transport is not None
        conn = self._transport.connection(dst.id)
        extension = _extension.get_extension()
        check = self._device_check("Request", dst.id)
        made: list[object] = []  # the extension's ext, once made
        if extension is None or internal or not extension.active():
            extension = None
            encoded = encode(payload, device_check=check)
        else:

            def make_ext(tensors: list[torch.Tensor]) -> Any:
                assert extension is not None
                made.append(extension.outgoing_request(dst.id, tensors, force))
                return made[-1]

            encoded = encode(payload, make_ext, check)
        self._check_size(encoded, dst.id)
        cid = next(self._ids)
        call = _Call(cid, conn, self._effective_timeout(timeout), internal, future, callback)
        if not internal:
            with self._active_lock:
                self._active += 1
        self._calls[cid] = call
        try:
            if self._describe:
                wrapped = bool(made) and made[0] is not None
                info = describe_request(payload[0], payload[1], wrapped=wrapped)
                conn.send_frame(
                    Kind.REQUEST, cid, encoded.meta, encoded.buffers, encoded.flags, info=info
                )
            else:
                conn.send_frame(Kind.REQUEST, cid, encoded.meta, encoded.buffers, encoded.flags)
        except BaseException:
            if self._calls.pop(cid, None) is not None:
                self._done(call)
            raise
        finally:
            if extension is not None:
                extension.sent()
        if conn.closed and self._calls.pop(cid, None) is not None:
            self._done(call)
            raise conn.broken_error()
        return cid, call

    def call_sync(
        self,
        dst: WorkerInfo,
        func: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        timeout: float = -1.0,
        *,
        force: bool = True,
        internal: bool = False,
    ) -> Any:
        """Send a request and wait for its result (raising remote errors).

        ``force`` asks the extension to record the call even without grad-requiring tensors
        (torch records every Python UDF call inside a context, but not builtin operators)."""
        if _profiling.wants(func):  # the only cost of profiling support when it is off
            return _profiling.call_sync(
                self.call_sync, self.worker_info, dst, func, args, kwargs, timeout, force, internal
            )
        cid, call = self._send(dst, (func, args, kwargs), timeout, None, internal, force)
        lock = call.lock
        assert lock is not None
        pool = self._member_pool()
        if pool is not None:  # a pool thread waiting here frees its slot meanwhile
            pool.enter_blocking()
        try:
            if call.timeout > 0:
                if not lock.acquire(timeout=call.timeout):
                    if self._calls.pop(cid, None) is not None:
                        self._done(call)
                        raise RpcTimeoutError(rpc_timeout_message(call.timeout))
                    lock.acquire()  # completed while we timed out: take the result
            else:
                lock.acquire()
        finally:
            if pool is not None:
                pool.exit_blocking()
        return self._result(call)

    def call_async(
        self,
        dst: WorkerInfo,
        func: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        timeout: float = -1.0,
        *,
        force: bool = True,
        internal: bool = False,
    ) -> torch.futures.Future[Any]:
        """Send a request; return a ``torch.futures.Future`` of its result."""
        if _profiling.wants(func):
            return _profiling.call_async(
                self.call_async, self.worker_info, dst, func, args, kwargs, timeout, force, internal
            )
        future = RpcFuture()
        future._pools = self._pools
        try:
            cid, call = self._send(dst, (func, args, kwargs), timeout, future, internal, force)
        except InjectedFailureError as exc:  # as torch's faulty agent: a failed future
            set_future_error(future, exc)
            return future
        if call.timeout > 0:
            self._arm_timeout(cid, call)
        return future

    def call_internal(
        self,
        dst: int,
        func: Any,
        args: tuple[Any, ...],
        on_done: Callable[[Any, BaseException | None], None],
        timeout: float = -1.0,
    ) -> None:
        """An internal request with no future: ``on_done(result, error)`` is called where the
        answer arrives -- the I/O thread, normally; the sending thread if the send itself fails
        after the call was registered; the timer when it times out (``timeout`` seconds, -1:
        the default RPC timeout, as torch's gradient messages; 0: none) -- so it must be quick
        and must not block. Raises (and does not call ``on_done``) if the request cannot be
        sent at all."""
        info = self.get_worker_info(dst)
        cid, call = self._send(info, (func, args, {}), timeout, None, True, False, on_done)
        if call.timeout > 0:
            self._arm_timeout(cid, call)

    def notify(self, dst: int, func: Any, args: tuple[Any, ...], *, later: bool = False) -> None:
        """Send a one-way internal message: the receiver runs ``func(*args)`` and answers
        nothing (an error there is logged there). The layer above learns of a lost peer through
        the agent's failure detection, not through this call. Raises if it cannot be sent.

        With ``later``, the message goes out with this worker's next write to ``dst`` (after
        that write's frame), or at the latest with the next heartbeat tick
        (``heartbeat_interval``): for messages nothing waits for, which then cost no write and
        no wake-up of the peer of their own. Such a message is lost if the connection fails
        before it went out."""
        if self._stopped:
            raise self._stopped_error("NOTIFY")
        conn = self.transport.connection(dst)
        encoded = encode((func, args))
        self._check_size(encoded, dst)
        info = describe_request(func, args, wrapped=False) if self._describe else None
        if later:
            conn.send_frame_later(
                Kind.NOTIFY, 0, encoded.meta, encoded.buffers, encoded.flags, info=info
            )
            return
        conn.send_frame(Kind.NOTIFY, 0, encoded.meta, encoded.buffers, encoded.flags, info=info)

    def peer_is_dead(self, dst: int) -> bool:
        """True once worker ``dst`` is known to be dead."""
        return self._transport is not None and self._transport.is_dead(dst)

    def send_with_retries(
        self, dst: int, func: Any, args: tuple[Any, ...], attempts: int = _RETRY_ATTEMPTS
    ) -> torch.futures.Future[Any]:
        """An internal message whose handler is idempotent (the reference's
        ``sendWithRetries``): a failure other than a dead peer or a stopped agent -- a timeout
        (each attempt has the default RPC timeout) included -- is retried, after a pause that
        doubles each time (``_RETRY_BACKOFF``). The future completes with
        the result or the last error."""
        result: torch.futures.Future[Any] = torch.futures.Future()

        def failed(exc: BaseException, left: int) -> None:
            if isinstance(exc, (PeerFailureError, RpcShutdownError)) or left <= 1:
                set_future_error(result, exc)
                return
            pause = _RETRY_BACKOFF * 2 ** (attempts - left)

            def retry() -> None:  # on the I/O thread: the attempt may block, so not here
                try:
                    self._callbacks.submit(attempt, left - 1)
                except RuntimeError:  # the pool is stopped: this agent stopped
                    set_future_error(result, exc)

            try:
                self._io.call_soon(self._io.loop.call_later, pause, retry)
            except RuntimeError:  # the I/O loop is gone: this agent stopped
                set_future_error(result, exc)

        def attempt(left: int) -> None:
            try:
                # the default timeout: an attempt that is lost is retried after it
                future = self.call_async(self.get_worker_info(dst), func, args, {}, internal=True)
            except BaseException as exc:  # the peer is gone, this agent stops, bad arguments
                set_future_error(result, exc)
                return

            def done(answered: torch.futures.Future[Any]) -> None:
                try:
                    value = answered.wait()
                except BaseException as exc:
                    failed(exc, left)
                else:
                    result.set_result(value)

            future.add_done_callback(done)

        attempt(attempts)
        return result

    def _member_pool(self) -> ThreadPool | None:
        """The agent's pool that the calling thread belongs to, if any."""
        for pool in self._pools:
            if pool.is_member():
                return pool
        return None

    @contextlib.contextmanager
    def blocking(self) -> Iterator[None]:
        """A block that waits for other workers: on a worker or callback thread, its pool slot
        is free meanwhile (so nested calls cannot exhaust the pool)."""
        pool = self._member_pool()
        if pool is None:
            yield
            return
        pool.enter_blocking()
        try:
            yield
        finally:
            pool.exit_blocking()

    def schedule(self, fn: Callable[[], Any]) -> None:
        """Run ``fn`` soon on a callback thread. Safe from anywhere, even ``__del__``: it takes
        no lock on the calling thread."""
        self._io.call_soon(self._run_scheduled, fn)

    def _run_scheduled(self, fn: Callable[[], Any]) -> None:
        if not self._stopped:
            self._callbacks.submit(fn)

    def _result(self, call: _Call) -> Any:
        if call.error is not None:
            raise call.error
        frame = call.frame
        assert frame is not None
        if frame.kind == Kind.ERROR:
            message, tb, pickled_type = loads(frame.meta)
            raise exception_from_payload(message, tb, pickled_type)
        extension = _extension.get_extension()
        if extension is None or call.internal:
            return decode(frame.meta, frame.buffers, frame.flags)[1]
        peer = call.conn.peer
        return decode(
            frame.meta,
            frame.buffers,
            frame.flags,
            lambda ext, tensors: extension.incoming_response(peer, ext, tensors),
        )[1]

    def _complete_future(self, call: _Call) -> None:
        future = call.future
        assert future is not None
        try:
            result = self._result(call)
        except BaseException as exc:
            set_future_error(future, exc)
        else:
            future.set_result(result)

    def _finish(self, call: _Call) -> None:
        """Hand a finished call (frame or error set) to whoever waits for it."""
        self._done(call)
        if call.lock is not None:
            call.lock.release()
        elif call.callback is not None:
            self._run_callback(call)
        else:
            try:
                self._callbacks.submit(self._complete_future, call)
            except RuntimeError:  # the callback pool is stopped (shutting down): complete here
                self._complete_future(call)

    def _run_callback(self, call: _Call) -> None:
        callback = call.callback
        assert callback is not None
        result: Any = None
        error: BaseException | None = None
        try:
            result = self._result(call)
        except BaseException as exc:
            error = exc
        try:
            callback(result, error)
        except BaseException:
            _log.exception("unhandled error in the answer handler of an internal call")

    def _done(self, call: _Call) -> None:
        if call.slot:
            with self._wheel_lock:
                bucket = self._wheel.get(call.slot)
                if bucket is not None:
                    bucket.discard(call.cid)
        if not call.internal:
            with self._active_lock:
                self._active -= 1

    def active_calls(self) -> int:
        """User calls from this worker still waiting for their response."""
        return self._active

    # -- timeouts of rpc_async -------------------------------------------------------------------
    def _arm_timeout(self, cid: int, call: _Call) -> None:
        slot = int((time.monotonic() + call.timeout) / _TICK) + 1
        with self._wheel_lock:
            if cid not in self._calls:
                return
            call.slot = slot
            self._wheel.setdefault(slot, set()).add(cid)
            start = not self._ticking
            self._ticking = True
        if start:
            self._io.call_soon(self._tick)

    def _tick(self) -> None:
        now_slot = int(time.monotonic() / _TICK)
        expired: list[int] = []
        with self._wheel_lock:
            for slot in [s for s in self._wheel if s <= now_slot]:
                expired.extend(self._wheel.pop(slot))
            more = bool(self._wheel)
            self._ticking = more and not self._stopped
        for cid in expired:
            call = self._calls.pop(cid, None)
            if call is not None:
                call.slot = 0
                call.error = RpcTimeoutError(rpc_timeout_message(call.timeout))
                self._finish(call)
        if more and not self._stopped:
            self._io.loop.call_later(_TICK, self._tick)

    # -- receiving (I/O thread) ------------------------------------------------------------------
    def on_frame(self, conn: Link, frame: Frame) -> None:
        if frame.kind == Kind.REQUEST:
            try:
                self._workers.submit(self._serve, conn, frame)
            except RuntimeError:  # the pool is stopped: say so rather than let the caller wait
                self._reply_error(
                    conn,
                    frame.message_id,
                    RpcShutdownError(
                        f"{self.worker_info.name} is shutting down and takes no more requests"
                    ),
                )
            return
        if frame.kind == Kind.NOTIFY:
            self._on_notify(conn, frame)
            return
        call = self._calls.pop(frame.message_id, None)
        if call is None:
            return  # the call timed out or was failed already; the late response is dropped
        call.frame = frame
        self._finish(call)

    def on_connection_lost(self, conn: Link, error: Exception, *, peer_dead: bool) -> None:
        for cid in [cid for cid, call in self._calls.items() if call.conn is conn]:
            call = self._calls.pop(cid, None)
            if call is not None:
                call.error = PeerFailureError(str(error), conn.peer_label)
                self._finish(call)
        if peer_dead:
            for listener in list(self.peer_failure_listeners):
                self._callbacks.submit(listener, conn.peer, error)

    def _on_notify(self, conn: Link, frame: Frame) -> None:
        try:
            func, args = loads(frame.meta, frame.buffers, frame.flags)
        except BaseException as exc:
            _log.warning(
                "dropped a notification from %s: cannot unpickle it: %r", conn.peer_label, exc
            )
            return
        if getattr(func, "_distgrad_on_io_thread", False):
            self._run_notification(func, args)
        elif self._stopped:
            return
        elif getattr(func, "_distgrad_after_current", False):
            self._workers.submit_after_current(self._run_notification, func, args)
        else:
            self._workers.submit(self._run_notification, func, args)

    @staticmethod
    def _run_notification(func: Any, args: tuple[Any, ...]) -> None:
        try:
            func(*args)
        except BaseException:
            _log.exception("unhandled error in the notification handler %r", func)

    # -- serving (worker threads) ----------------------------------------------------------------
    def _serve(self, conn: Link, frame: Frame) -> None:
        extension = _extension.get_extension()
        states: list[Any] = []

        def on_table(ext: Any, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
            assert extension is not None
            tensors, state = extension.incoming_request(conn.peer, ext, tensors)
            states.append(state)
            return tensors

        previous = RRefContext.start_collecting()
        try:
            _ext, (func, args, kwargs) = decode(
                frame.meta, frame.buffers, frame.flags, on_table if extension else None
            )
        except BaseException as exc:
            if isinstance(exc, (AttributeError, ImportError)):
                error = RuntimeError(f"{_UDF_MISSING} ({exc!r})")
                report_udf_error(error, str(self.worker_info))
            else:
                error = RuntimeError(f"could not unpickle the request: {exc!r}")
            unrun: BaseException | None = error
        else:
            unrun = None
        finally:
            unconfirmed = RRefContext.stop_collecting(previous)
        if self._describe and unrun is None:  # replies go out described (fault injection)
            wrapped = bool(states) and states[0] is not None
            conn = _ReplyLink(conn, describe_request(func, args, wrapped=wrapped))
        if unrun is None and unconfirmed:  # RRefs in the arguments: run once owners know them
            try:
                self._wait_confirmed(unconfirmed)
            except BaseException as exc:
                unrun = exc
        if unrun is not None:
            # Failed before the function ran. A remote() creation's error is its value's (as
            # if the function had raised it), and the creation is answered: a to_here()
            # already on its way raises it instead of waiting for a value never set.
            if self.rrefs.fail_creation(unrun):
                self._reply(conn, frame.message_id, None, None)
            else:
                self._reply_error(conn, frame.message_id, unrun)
            return
        del frame.buffers[:]
        state = states[0] if states else None
        try:
            if state is None:
                if getattr(func, "_wrapped_async_rpc_function", None) is not None:
                    self._serve_async(conn, frame.message_id, func, args, kwargs, None)
                    return
                result = func(*args, **(kwargs or {}))
            else:
                assert extension is not None
                with extension.scope(state):
                    if getattr(func, "_wrapped_async_rpc_function", None) is not None:
                        self._serve_async(conn, frame.message_id, func, args, kwargs, state)
                        return
                    result = func(*args, **(kwargs or {}))
        except BaseException as exc:
            # builtin operators' and TorchScript functions' errors keep their bare message;
            # TorchScript's own (torch.jit.Error) arrive as RuntimeError, as torch's do
            builtin = is_builtin(func)
            if is_script_function(func):
                builtin = True
                if not isinstance(exc, RuntimeError):
                    exc = RuntimeError(str(exc))
            if not builtin:  # as the reference's callee: a Python function's error is printed
                report_udf_error(exc, str(self.worker_info))
            self._reply_error(conn, frame.message_id, exc, builtin=builtin)
            return
        self._reply(conn, frame.message_id, result, state)

    def _wait_confirmed(self, users: list[Any]) -> None:
        """Wait until the owners confirmed the UserRRefs received in a request (the reference
        runs no user function before that), or raise why they never will be."""
        timeout = self.rpc_timeout if self.rpc_timeout > 0 else None
        deadline = time.monotonic() + timeout if timeout is not None else None
        with self.blocking():
            for rref in users:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                if not rref._settled.wait(left):
                    raise RpcTimeoutError(rpc_timeout_message(self.rpc_timeout))
                rref._check_usable()

    def _serve_async(
        self,
        conn: Link,
        message_id: int,
        func: Any,
        args: Any,
        kwargs: Any,
        state: Any,
    ) -> None:
        future = check_async_result(func(*args, **(kwargs or {})))
        with self._active_lock:
            self._serving_async += 1

        def respond(done: torch.futures.Future[Any]) -> None:
            with self._active_lock:
                self._serving_async -= 1
            try:
                result = done.value()
            except BaseException as exc:
                self._reply_error(conn, message_id, exc)
                return
            self._reply(conn, message_id, result, state)

        future.add_done_callback(respond)

    def _reply(self, conn: Link, message_id: int, result: Any, state: Any) -> None:
        extension = _extension.get_extension()
        peer = conn.peer
        check = self._device_check("Response", peer)
        if state is None or extension is None:
            try:
                encoded = encode(result, device_check=check)
                self._check_size(encoded, peer)
            except BaseException as exc:
                self._reply_error(conn, message_id, exc)
                return
            self._write(conn, Kind.RESPONSE, message_id, encoded.meta, encoded.buffers)
            return
        try:
            try:
                encoded = encode(
                    result,
                    lambda tensors: extension.outgoing_response(state, peer, tensors),
                    check,
                )
                self._check_size(encoded, peer)
            except BaseException as exc:
                self._reply_error(conn, message_id, exc)
                return
            flags = encoded.flags
            self._write(conn, Kind.RESPONSE, message_id, encoded.meta, encoded.buffers, flags)
        finally:
            extension.sent()

    def _device_check(self, direction: str, rank: int) -> Callable[[torch.Tensor], torch.Tensor]:
        """What the pickler calls for a tensor that is not on the CPU: distgrad moves only CPU
        tensors (device maps are accepted, not applied yet), so it raises the reference's error
        for a destination without a device map -- instead of letting torch's own pickling copy
        the tensor through the CPU and rebuild it on whatever device the receiver has."""
        key = (direction, rank)
        check = self._device_checks.get(key)
        if check is None:
            info = self._by_rank.get(rank)
            name = info.name if info is not None else str(rank)
            mapped = name in self.options.device_maps

            def refuse(tensor: torch.Tensor) -> torch.Tensor:
                if mapped:
                    raise RuntimeError(
                        f"distgrad does not move {tensor.device} tensors over RPC yet: device "
                        f"maps are accepted but not applied (destination {name}); move the "
                        "tensor to the CPU before sending it"
                    )
                raise RuntimeError(
                    f"{_CPU_ONLY}{direction} device mapping is not available for destination "
                    f"{name}, but found tensor on device: {tensor.device}"
                )

            check = self._device_checks[key] = refuse
        return check

    def _check_size(self, encoded: Encoded, dst: int) -> None:
        """Refuse to send what this worker, or the peer (whose limit came with its address),
        would refuse to receive: the peer would drop the connection, and the call would fail
        without saying why, and every call on that connection with it."""
        limit = self.options.max_message_size
        peer_limit = self._peer_limits.get(dst)
        if peer_limit is not None:
            limit = peer_limit
        size = len(encoded.meta)
        if encoded.buffers:
            size += sum(buffer.raw().nbytes for buffer in encoded.buffers)
        if size > limit:
            whose = "" if peer_limit is None else f" of {self._label(dst)}"
            raise MessageTooLargeError(
                f"message of {size} bytes exceeds the maximum message size{whose} of {limit} "
                "bytes (TensorPipeRpcBackendOptions(max_message_size=...))"
            )

    def _reply_error(
        self, conn: Link, message_id: int, exc: BaseException, builtin: bool = False
    ) -> None:
        payload = error_payload(exc, str(self.worker_info), builtin)
        self._write(conn, Kind.ERROR, message_id, dumps(payload)[0])

    def _write(
        self,
        conn: Link,
        kind: int,
        message_id: int,
        meta: bytes,
        buffers: list[pickle.PickleBuffer] | None = None,
        flags: int = 0,
    ) -> None:
        try:
            conn.send_frame(kind, message_id, meta, buffers, flags)
        except DistgradError as exc:
            _log.debug("not sending a response to %s: %s", conn.peer_label, exc)

    # -- shutdown --------------------------------------------------------------------------------
    def wait_until_idle(self, deadline: float | None) -> None:
        """Wait until no user call from this worker is in flight (or raise at ``deadline``)."""
        while self._active > 0:
            if deadline is not None and time.monotonic() > deadline:
                raise RpcTimeoutError(
                    f"{self._active} RPCs from {self.worker_info.name} still in flight at the "
                    "shutdown timeout"
                )
            time.sleep(0.002)

    def stop(self, graceful: bool) -> None:
        """Close connections (flushing first when ``graceful``), fail what still waits, and end
        every thread the agent owns. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        self._running = False
        if graceful:
            # Requests being served finish and write their responses before the connections
            # close (a follower leaving shutdown's last all-gather must not close the connection
            # before its answer to the leader's broadcast has gone out).
            self._workers.stop()
        if self._transport is not None:
            self._transport.close(graceful)
        error = RpcShutdownError("RPC agent was shut down before the call completed")
        for cid in list(self._calls):
            call = self._calls.pop(cid, None)
            if call is not None:
                call.error = error
                self._finish(call)
        self._workers.stop()
        self._callbacks.stop()
        self._io.stop()
        self.keepalive.clear()
        self.rref_leaks = self.rrefs.destroy()


class _ReplyLink:
    """The link of a request, for its replies, where the transport wants each frame described:
    it describes them as the response (or error) to that request."""

    def __init__(self, link: Link, request: MessageInfo) -> None:
        self._link = link
        self._request = request
        self.peer = link.peer
        self.peer_label = link.peer_label

    @property
    def closed(self) -> bool:
        return self._link.closed

    def send_frame(
        self,
        kind: int,
        message_id: int,
        meta: bytes,
        buffers: list[pickle.PickleBuffer] | None = None,
        flags: int = 0,
        *,
        info: MessageInfo | None = None,
    ) -> None:
        described = describe_response(self._request, error=kind == Kind.ERROR)
        self._link.send_frame(kind, message_id, meta, buffers, flags, info=described)

    def send_frame_later(
        self,
        kind: int,
        message_id: int,
        meta: bytes,
        buffers: list[pickle.PickleBuffer] | None = None,
        flags: int = 0,
        *,
        info: MessageInfo | None = None,
    ) -> None:
        described = describe_response(self._request, error=kind == Kind.ERROR)
        self._link.send_frame_later(kind, message_id, meta, buffers, flags, info=described)

    def broken_error(self) -> DistgradError:
        return self._link.broken_error()

    def close(self, error: Exception | None = None) -> None:
        self._link.close(error)


_current: RpcAgent | None = None


class _ThreadAgent(threading.local):
    agent: RpcAgent | None = None  # class default: an unbound thread reads None


#: The agent the calling thread belongs to, where several share the process (else None).
thread_binding = _ThreadAgent()


def current_agent() -> RpcAgent | None:
    """The agent of the calling thread: the one it is bound to (in-memory worlds), else the
    process's (``init_rpc``)."""
    bound = thread_binding.agent
    return bound if bound is not None else _current


def bind_thread(agent: RpcAgent | None) -> RpcAgent | None:
    """Make ``agent`` the calling thread's agent (``None``: unbind); returns the previous one."""
    previous = thread_binding.agent
    thread_binding.agent = agent
    return previous


def set_current_agent(agent: RpcAgent | None) -> None:
    global _current
    _current = agent
