"""The outgoing stages of the agent: a call is encoded (``_codec``), registered in the calls
table (``_call_table``) and sent; its answer -- a response, an error reply, a timeout, a peer
failure or the agent stopping -- completes or fails it, for whoever waits: the caller's thread
(``rpc_sync``), a future completed on a callback thread (``rpc_async``), or an internal
callback run where the answer arrives (``call_internal``).

:class:`Outgoing` is a stage of :class:`~distgrad._rpc._core._agent.RpcAgent`: it owns the
calls table and is given what else it uses (the agent's running state, ``_shared``)."""

from __future__ import annotations

import logging
import pickle
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from ..._devices._backend import Process, take_arrivals
from ..._devices._maps import DeviceMap
from ..._errors import (
    MAYBE_RUN,
    FrameNotSentError,
    InjectedFailureError,
    PeerFailureError,
    RpcTimeoutError,
    rpc_timeout_message,
)
from ..._transport._base import Link, MessageInfo
from ..._transport._io import IoThread
from ..._wire._choice import state as choice
from ..._wire._frames import Frame, Kind
from ..._wire._pickler import HAS_TABLE, LEAN, PLAIN, decode, encode, lean_kind, loads
from . import _delivery, _layer, _profiling, _tracing
from ._call_table import TICK, CallTable
from ._calls import RpcFuture, _Call, is_builtin, set_future_error
from ._codec import Codec
from ._extension import CallRecord
from ._layer import recording
from ._messages import describe_request
from ._pool import ThreadPool, membership
from ._remote_error import exception_from_payload
from ._shared import Shared
from ._statistics import (
    FUNCTION_LABELS,
    OTHER,
    OUTCOMES,
    PEER_FAILURE,
    REMOTE,
    TIMEOUT,
    StatisticsRecorder,
    function_label,
)
from ._worker_info import WorkerInfo

__all__ = ["Outgoing"]

_log = logging.getLogger("distgrad.rpc")
_dumps = pickle.dumps
# An rpc_async future made without torch's Python constructor (its keyword handling and a
# list comprehension over no devices): what ``RpcFuture()`` does, two Python calls fewer.
_new_future = RpcFuture.__new__
_init_future = torch._C.Future.__init__
_autograd: Any = torch.autograd
_profiler_enabled: Callable[[], bool] = _autograd._profiler_enabled


#: what an internal call's answer is handed to: ``(result, error)``
AnswerCallback = Callable[[Any, BaseException | None], None]


def _let_go(call: _Call) -> None:
    """Give back the read role the sender of ``call`` took for its answer, if it did."""
    if call.held:
        call.held = False
        call.conn.release_read()  # type: ignore[attr-defined]


class Outgoing:
    """Requests out, answers back: a stage of the agent, which makes it and hands it what it
    uses. It owns the calls table (:attr:`calls`) and the count of user calls in flight."""

    def __init__(
        self,
        shared: Shared,
        *,
        codec: Codec,
        io: IoThread,
        callbacks: ThreadPool,
        pools: tuple[ThreadPool, ...],
        stats: StatisticsRecorder,
        lookup: Callable[[int], WorkerInfo],
    ) -> None:
        self._shared = shared
        self._codec = codec
        self._io = io
        #: completes ``rpc_async`` futures (never on the I/O thread)
        self._callbacks = callbacks
        #: the agent's pools: a thread of one of them that waits for an answer frees its slot
        self._pools = pools
        self._stats = stats
        #: the worker of a rank (the agent's ``get_worker_info``)
        self._lookup = lookup
        #: the calls waiting for their answer, and their timeouts
        self.calls = CallTable()
        self._active = 0  # user calls in flight (not internal ones)
        self._active_lock = threading.Lock()

    # -- send: encode, register, write -----------------------------------------------------------
    def _send(
        self,
        dst: WorkerInfo,
        payload: tuple[Any, ...],
        timeout: float,
        future: torch.futures.Future[Any] | None,
        *,
        internal: bool,
        force: bool | None,
        callback: AnswerCallback | None = None,
        device_map: DeviceMap | None = None,
    ) -> _Call:
        """Send a request, whatever it holds (the general path; :meth:`_send_plain` is the
        lean one). ``force``: see :meth:`call_sync`."""
        if self._shared.stopped:
            raise self._shared.stopped_error("REQUEST")
        assert self._shared.transport is not None
        span = None
        if _tracing.active:  # the caller's span; its traceparent travels as a 4th element
            span = _tracing.client(
                self._shared.worker_info.name, dst.name, function_label(payload[0])
            )
            payload = (*payload, _tracing.traceparent(span))
        try:
            conn = self._shared.transport.connection(dst.id)
        except PeerFailureError:  # (a peer known dead: the call is counted, and fails)
            self._count_unsent(dst.id, payload[0], span)
            raise
        extension = _layer._recorder  # (the registry's field: no call on the call path)
        check = self._codec.device_check("Request", dst.id, device_map)
        made: list[CallRecord | None] = []  # the extension's ext, once made
        encoding = _delivery.encoding  # (what is pickled into it may ask to hear of failure)
        settle: _delivery.FailureCallbacks = []
        encoding.dst = dst.id
        encoding.callbacks = settle
        try:
            if (
                extension is None
                or internal
                or (_layer.recorder_counts and not recording.reasons)
                or not extension.active()
            ):
                extension = None
                encoded = encode(payload, device_check=check)
            else:
                if force is None:  # a user's call: recorded unless it calls a builtin operator
                    force = not is_builtin(payload[0])

                def make_ext(tensors: list[torch.Tensor]) -> CallRecord | None:
                    assert extension is not None
                    record = extension.outgoing_request(dst.id, tensors, bool(force))
                    if record is not None and check.map:  # the forward carries the device map
                        record = record._replace(device_map=check.map)
                    made.append(record)
                    return record

                encoded = encode(payload, make_ext, check)
            size = self._codec.check_size(encoded, dst.id)
        except BaseException:
            _delivery.run_failure_callbacks(settle, False)  # never sent
            raise
        finally:
            encoding.dst = -1
            encoding.callbacks = None
        call = _Call(
            self.calls.next_id(),
            conn,
            self._shared.rpc_timeout if timeout < 0 else timeout,
            future,
            internal=internal,
            callback=callback,
        )
        try:  # (the cache's common case inline: no call)
            call.function = FUNCTION_LABELS[payload[0]]
        except (KeyError, TypeError):
            call.function = function_label(payload[0])
        call.started = time.perf_counter()
        call.span = span
        if settle:
            call.settle = settle
        info = None
        if self._shared.describe:
            wrapped = bool(made) and made[0] is not None
            info = describe_request(payload[0], payload[1], wrapped=wrapped)
        try:
            self._post(call, dst, size, encoded.meta, encoded.buffers, encoded.flags, info)
        finally:
            if extension is not None:
                extension.sent()
        return call

    def _send_plain(
        self,
        dst: WorkerInfo,
        payload: tuple[Any, ...],
        timeout: float,
        future: torch.futures.Future[Any] | None,
        lean: int = PLAIN,
    ) -> _Call:
        """Send a user's request on the lean path (its preconditions: :meth:`_lean`, which
        says ``lean``). What :meth:`_send` does that such a request has no use for is left
        out: no tracing span, no description, no recording, no object in it to hear of its
        failure. A ``PLAIN`` one (no tensor, so no device routing either) is pickled by plain
        ``pickle``, as the tensor-aware pickler would (``is_plain``); a ``LEAN`` one (CPU
        tensors) by the tensor-aware pickler, as :meth:`_send` would, and flagged ``LEAN``
        unless its device map moves CPU tensors to a device. The flag sends it down the
        callee's lean path."""
        shared = self._shared
        if shared.stopped:
            raise shared.stopped_error("REQUEST")
        assert shared.transport is not None
        try:
            conn = shared.transport.connection(dst.id)
        except PeerFailureError:  # (a peer known dead: the call is counted, and fails)
            self._count_unsent(dst.id, payload[0], None)
            raise
        buffers = None
        if lean == PLAIN:
            meta = _dumps(payload, 5)
            size = len(meta)
            if size > self._codec.least_limit:
                self._codec.check_bytes(size, dst.id)
        else:
            check = self._codec.device_check("Request", dst.id)
            encoded = encode(payload, device_check=check)
            size = self._codec.check_size(encoded, dst.id)
            meta, buffers = encoded.meta, encoded.buffers
            lean = encoded.flags if check.routes_cpu else encoded.flags | LEAN
        call = _Call(
            self.calls.next_id(),
            conn,
            shared.rpc_timeout if timeout < 0 else timeout,
            future,
            internal=False,
        )
        func = payload[0]  # (a function: hashable)
        call.function = FUNCTION_LABELS.get(func) or function_label(func)
        call.started = time.perf_counter()
        self._post(call, dst, size, meta, buffers, lean, None)
        return call

    def _lean(self, payload: tuple[Any, ...]) -> int:
        """Whether a user's request takes the lean path (:meth:`_send_plain`, issue 28), and
        how: ``PLAIN``, ``LEAN`` or 0 (the general path, :meth:`_send`). Its preconditions:
        nothing to record (no layer records calls, or it keeps ``recording`` and no
        distributed autograd context is current on this thread), no tracing, no transport
        that wants frames described (fault injection), the default pickler, and a payload of
        a lean shape: ``is_plain`` (atoms and functions by reference -- no tensor, so no
        device map applies, and no object that asks to hear of the call's failure) or
        ``is_lean`` (the same with CPU tensors). Both paths register and write the request
        through :meth:`_post`, and their answers come back the same way."""
        if (
            (_layer._recorder is None or (_layer.recorder_counts and not recording.reasons))
            and not _tracing.active
            and not self._shared.describe
            and choice.picklers is None
        ):
            return lean_kind(payload)
        return 0

    def _count_unsent(self, dst: int, func: Any, span: Any) -> None:
        """Count a call to a peer known dead, which fails before it is registered."""
        self._stats.sent(dst, 0)
        self._stats.answered(dst, 0, function_label(func), 0.0, PEER_FAILURE)
        if span is not None:
            span.end("peer_failure")

    def _post(
        self,
        call: _Call,
        dst: WorkerInfo,
        size: int,
        meta: bytes,
        buffers: list[pickle.PickleBuffer] | None,
        flags: int,
        info: MessageInfo | None,
    ) -> None:
        """Register ``call`` (its request of ``size`` bytes encoded) and write its request --
        the part both paths share: the resend of a request the connection did not take, and
        the failure of one whose link broke meanwhile."""
        calls = self.calls
        cid = call.cid
        if not call.internal:
            with self._active_lock:
                self._active += 1
        deadline = 0.0  # rpc_async and internal calls time out in the wheel (rpc_sync: its lock)
        if call.lock is None and call.timeout > 0:
            deadline = time.monotonic() + call.timeout
        if calls.add(call, deadline):
            self._io.call_soon(self._tick)
        self._stats.sent(dst.id, size)
        conn = call.conn
        if call.lock is not None:  # rpc_sync: its caller will read the answer itself
            hold = getattr(conn, "hold_read", None)  # (taken before the request goes out,
            call.held = hold is not None and hold()  # so the answer cannot reach another)
        try:
            try:
                conn.send_frame(Kind.REQUEST, cid, meta, buffers, flags, info=info)
            except FrameNotSentError as exc:
                # The connection was found dead before any byte of the request left: the peer
                # cannot have run it, so it goes once more, on a fresh connection. (The loss
                # of the link left this call alone: it is still being sent, see _call_table.)
                _let_go(call)
                if calls.pop(cid) is None:  # the agent stopped meanwhile
                    raise PeerFailureError(str(exc), exc.peer) from exc
                conn = self._resend(call, dst, exc)
                if calls.add(call, deadline):
                    self._io.call_soon(self._tick)
                conn.send_frame(Kind.REQUEST, cid, meta, buffers, flags, info=info)
        except FrameNotSentError as exc:
            _let_go(call)
            if calls.pop(cid) is not None:
                self._done(call, PEER_FAILURE)
            _delivery.run_failure_callbacks(call.settle, False)
            raise PeerFailureError(
                f"{exc} (the request was not sent: it was tried again on a new connection, "
                "which failed too)",
                exc.peer,
            ) from exc
        except BaseException:
            _let_go(call)
            if calls.pop(cid) is not None:
                self._done(call)
            _delivery.run_failure_callbacks(call.settle, False)  # (nothing was written)
            raise
        calls.sent(call)
        # The link broke after the call was registered: its failure may have taken the calls
        # out before this one was in, or while it was being written (see _call_table), so
        # fail it here if it is still there.
        if conn.closed and calls.pop(cid) is not None:
            _let_go(call)
            self._done(call, PEER_FAILURE)
            _delivery.run_failure_callbacks(call.settle, True)
            raise PeerFailureError(f"{conn.broken_error()}{MAYBE_RUN}", conn.peer_label)

    def _resend(self, call: _Call, dst: WorkerInfo, error: FrameNotSentError) -> Link:
        """A fresh connection for ``call`` (out of the table), whose request could not be
        written; raises (the call counted as failed) if there is none."""
        assert self._shared.transport is not None
        try:
            if self._shared.stopped:
                raise self._shared.stopped_error("REQUEST")
            conn = self._shared.transport.connection(dst.id)
        except BaseException as exc:
            self._done(call, PEER_FAILURE if isinstance(exc, PeerFailureError) else OTHER)
            raise
        _log.debug("resending call %d to %s on a new connection: %s", call.cid, dst.name, error)
        self._stats.resent(dst.id)
        call.conn = conn
        return conn

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
        """Send a request and wait for its result (raising remote errors).

        ``force`` asks the extension to record the call even without grad-requiring tensors
        (torch records every Python UDF call inside a context, but not builtin operators);
        ``None``: as for a user's call, recorded unless ``func`` is a builtin operator."""
        if _profiler_enabled() and _profiling.wants(func):  # (off: one C call, no more)
            return _profiling.call_sync(
                self.call_sync,
                self._shared.worker_info,
                dst,
                func,
                args,
                kwargs,
                timeout,
                not is_builtin(func) if force is None else force,  # (it wraps func)
                internal,
            )
        payload = (func, args, kwargs)
        lean = 0 if internal else self._lean(payload)
        if lean:
            call = self._send_plain(dst, payload, timeout, None, lean)
        else:
            call = self._send(dst, payload, timeout, None, internal=internal, force=force)
        lock = call.lock
        assert lock is not None
        pool = membership.pool  # (member_pool, inline: this is on every call's path)
        if pool is not None and pool in self._pools:  # a pool thread waiting here frees its
            pool.enter_blocking()  # slot meanwhile
        else:
            pool = None
        try:
            timeout = call.timeout
            # Waiting alone, the caller reads its own answer off the connection (no thread
            # woken to hand it over); if another thread reads it, the answer is handed over.
            read_until = getattr(call.conn, "read_until", None)
            if read_until is None:
                answered = False
            elif timeout > 0:
                started = time.monotonic()
                answered = read_until(lock, timeout, held=call.held)
                timeout = max(0.001, timeout - (time.monotonic() - started))
            else:
                answered = read_until(lock, 0.0, held=call.held)
            call.held = False  # (given back by read_until)
            if answered:
                pass
            elif timeout > 0:
                if not lock.acquire(timeout=timeout):
                    if self.calls.pop(call.cid) is not None:
                        self._done(call, TIMEOUT)
                        _delivery.run_failure_callbacks(call.settle, True)
                        raise RpcTimeoutError(rpc_timeout_message(call.timeout))
                    lock.acquire()  # completed while we timed out: take the result
            else:
                lock.acquire()
        finally:
            if pool is not None:
                pool.exit_blocking()
        try:
            result = self._result(call)
        finally:
            if Process.seen:  # the caller's current streams wait for what arrived on devices
                self._codec.backend.join_current(take_arrivals())  # (after a failed decode too)
        return result

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
        """Send a request; return a ``torch.futures.Future`` of its result (``force``: see
        :meth:`call_sync`)."""
        if _profiler_enabled() and _profiling.wants(func):  # (off: one C call, no more)
            return _profiling.call_async(
                self.call_async,
                self._shared.worker_info,
                dst,
                func,
                args,
                kwargs,
                timeout,
                not is_builtin(func) if force is None else force,  # (it wraps func)
                internal,
            )
        if self._codec.backend.name == "cpu":
            future = _new_future(RpcFuture)
            _init_future(future, [])
        else:
            future = self._device_future()
        future._pools = self._pools
        payload = (func, args, kwargs)
        try:
            lean = 0 if internal else self._lean(payload)
            if lean:
                self._send_plain(dst, payload, timeout, future, lean)
            else:
                self._send(dst, payload, timeout, future, internal=internal, force=force)
        except InjectedFailureError as exc:  # as torch's faulty agent: a failed future
            set_future_error(future, exc)
        return future  # (its timeout, if any, runs in the wheel: armed with its registration)

    def _device_future(self) -> RpcFuture:
        """The future of a call whose result may hold CUDA tensors: torch's device-aware
        future over this worker's devices (its ``wait()`` makes the waiter's streams wait)."""
        future: RpcFuture = self._codec.backend.new_future(RpcFuture, self._codec.plan.devices)
        return future

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
        """An internal request with no future: ``on_done(result, error)`` is called where the
        answer arrives -- the I/O thread, normally; the sending thread if the send itself fails
        after the call was registered; the timer when it times out (``timeout`` seconds, -1:
        the default RPC timeout, as torch's gradient messages; 0: none) -- so it must be quick
        and must not block. Raises (and does not call ``on_done``) if the request cannot be
        sent at all. ``device_map`` routes its tensors instead of this worker's map to ``dst``
        (a gradient message: the inverse of the map its forward call came with)."""
        info = self._lookup(dst)
        self._send(  # (its timeout, if any, runs in the wheel: armed with its registration)
            info,
            (func, args, {}),
            timeout,
            None,
            internal=True,
            force=False,
            callback=on_done,
            device_map=device_map,
        )

    # -- complete or fail ------------------------------------------------------------------------
    def on_answer(self, frame: Frame) -> None:
        """A response or error reply arrived (I/O thread)."""
        call = self.calls.pop(frame.message_id)
        if call is None:
            return  # the call timed out or was failed already; the late response is dropped
        call.frame = frame
        self._finish(call)

    def fail_calls_on(self, conn: Link, error: Exception) -> None:
        """Fail every call waiting on ``conn``, which broke (I/O thread): their requests were
        written (or partly), so the peer may have run them."""
        for call in self.calls.take_on(conn):
            call.error = PeerFailureError(f"{error}{MAYBE_RUN}", conn.peer_label)
            self._finish(call)

    def fail_all_calls(self, error: BaseException) -> None:
        for call in self.calls.take_all():
            call.error = error
            self._finish(call)

    def _result(self, call: _Call) -> Any:
        if call.error is not None:
            raise call.error
        frame = call.frame
        assert frame is not None
        if frame.kind == Kind.ERROR:
            message, tb, pickled_type = loads(frame.meta)
            raise exception_from_payload(message, tb, pickled_type)
        extension = _layer._recorder  # (the registry's field: no call on the call path)
        if extension is None or call.internal or not frame.flags & HAS_TABLE:
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
            if Process.seen:
                take_arrivals()  # a decode that failed halfway: forget what it put on devices
            set_future_error(future, exc)
            return
        arrivals = take_arrivals() if Process.seen else None
        if arrivals is None:
            future.set_result(result)
            return
        # completed under the streams that carried the result: a device-aware future records
        # its events there, and its wait() makes the waiter's current streams wait on them
        with self._codec.backend.running_under(arrivals):
            future.set_result(result)

    def _finish(self, call: _Call) -> None:
        """Hand a finished call (taken out of the table; frame or error set) to whoever waits
        for it."""
        self._done(call)
        if call.settle is not None:
            frame = call.frame
            if call.error is not None or frame is None or frame.kind == Kind.ERROR:
                _delivery.run_failure_callbacks(call.settle, True)  # (it may have arrived)
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
        if Process.seen:  # handed on to other threads: complete on the host first
            self._codec.backend.settle(take_arrivals())
        try:
            callback(result, error)
        except BaseException:
            _log.exception("unhandled error in the answer handler of an internal call")

    def _done(self, call: _Call, outcome: int = OTHER) -> None:
        """Count a call that ended (taken out of the table): ``outcome`` says how where
        neither its answer nor its error does."""
        seconds = time.perf_counter() - call.started
        frame = call.frame
        error = call.error
        if error is not None:
            if isinstance(error, RpcTimeoutError):
                outcome = TIMEOUT
            elif isinstance(error, PeerFailureError):
                outcome = PEER_FAILURE
            else:
                outcome = OTHER
        if frame is None:
            self._stats.answered(call.conn.peer, 0, call.function, seconds, outcome)
        else:
            size = len(frame.meta)
            for buffer in frame.buffers:  # (a loop: a generator costs more for one or two)
                size += buffer.nbytes
            if error is None:
                outcome = REMOTE if frame.kind == Kind.ERROR else 0
            self._stats.answered(call.conn.peer, size, call.function, seconds, outcome)
        if call.span is not None:
            call.span.end(OUTCOMES[outcome])
        if not call.internal:
            with self._active_lock:
                self._active -= 1

    def active_calls(self) -> int:
        """User calls from this worker still waiting for their response."""
        return self._active

    def wait_until_idle(self, deadline: float | None) -> None:
        """Wait until no user call from this worker is in flight (or raise at ``deadline``)."""
        while self._active > 0:
            if deadline is not None and time.monotonic() > deadline:
                raise RpcTimeoutError(
                    f"{self._active} RPCs from {self._shared.worker_info.name} still in flight "
                    "at the shutdown timeout"
                )
            time.sleep(0.002)

    # -- timeouts of rpc_async and internal calls (I/O thread) -----------------------------------
    def _tick(self) -> None:
        expired, more = self.calls.expire(time.monotonic(), stopping=self._shared.stopped)
        for call in expired:
            call.error = RpcTimeoutError(rpc_timeout_message(call.timeout))
            self._finish(call)
        if more:
            self._io.loop.call_later(TICK, self._tick)
