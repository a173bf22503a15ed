"""The serving stages of the agent: a request arrives (I/O thread) and goes to the worker pool,
where it is decoded, waits until the references in its arguments are usable (the layer that
tracks references, RRefs, says which and when; see ``_layer``), runs, and is answered (its
result encoded as a response, or its error as an error reply); a one-way notification runs its
handler where it is marked to.

:class:`Serving` is a stage of :class:`~distgrad._rpc._core._agent.RpcAgent`, given what it uses
(the agent's running state, ``_shared``)."""

from __future__ import annotations

import contextlib
import logging
import pickle
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from ..._devices._backend import Arrivals, Process, take_arrivals
from ..._errors import DistgradError, RpcShutdownError
from ..._transport._base import Link, MessageInfo
from ..._wire import _choice
from ..._wire._choice import state as choice
from ..._wire._frames import Frame, Kind
from ..._wire._guard import RefusedError
from ..._wire._pickler import HAS_TABLE, LEAN, PLAIN, decode, dumps, encode, is_plain, loads
from . import _layer, _profiling, _tracing
from ._calls import check_async_result, is_builtin
from ._codec import UDF_MISSING, Codec
from ._lane import SerialLane
from ._layer import LayerAgent
from ._messages import describe_request, describe_response
from ._pool import ThreadPool
from ._remote_error import error_payload, report_udf_error
from ._shared import Shared
from ._statistics import StatisticsRecorder, function_label
from ._torchscript import is_script_function

__all__ = ["Serving"]

_log = logging.getLogger("distgrad.rpc")
_loads = pickle.loads
_LEAN_FLAGS = PLAIN | LEAN
_dumps = pickle.dumps


class Serving:
    """Requests in, replies out: a stage of the agent, which makes it and hands it what it
    uses. It owns the count of ``@async_execution`` requests pending and the GIL-wait timing
    (``rpc.enable_gil_profiling``)."""

    def __init__(
        self,
        shared: Shared,
        *,
        agent: LayerAgent,
        codec: Codec,
        workers: ThreadPool,
        lane: SerialLane,
        stats: StatisticsRecorder,
        blocking: Callable[[], contextlib.AbstractContextManager[None]],
    ) -> None:
        self._shared = shared
        #: the agent, as the layers above know it (their hooks are handed it)
        self._agent = agent
        self._codec = codec
        #: where requests run
        self._workers = workers
        #: where one-way messages with device tensors are decoded, off the I/O thread
        self._lane = lane
        self._stats = stats
        #: a block that waits for other workers (frees the worker's pool slot meanwhile)
        self._blocking = blocking
        self._lock = threading.Lock()
        self._here = _Here()  # a worker lingering on its connection (_serve_and_linger)
        #: ``@async_execution`` requests whose future is pending
        self.serving_async = 0
        # rpc.enable_gil_profiling: how long served requests waited for a thread to run them
        self.gil_profiling = False
        self.gil_wait = [0.0, 0]  # seconds in all, requests

    def enable_gil_profiling(self, flag: bool) -> None:
        """Time each request's wait for a thread (see ``RpcAgent.enable_gil_profiling``):
        turning it on resets the figures, turning it off keeps them."""
        if flag and not self.gil_profiling:
            self.gil_wait = [0.0, 0]
        self.gil_profiling = bool(flag)

    # -- receive (I/O thread) --------------------------------------------------------------------
    def on_request(self, conn: Link, frame: Frame) -> None:
        try:
            if self.gil_profiling:
                self._workers.submit(self._serve_timed, conn, frame, time.perf_counter())
            else:
                self._workers.submit(self._serve_and_linger, conn, frame)
        except RuntimeError:  # the pool is stopped: say so rather than let the caller wait
            self._reply_error(
                conn,
                frame.message_id,
                RpcShutdownError(
                    f"{self._shared.worker_info.name} is shutting down and takes no more requests"
                ),
            )

    def on_notify(self, conn: Link, frame: Frame) -> None:
        lane = self._lane
        if (frame.buffers and self._codec.backend.name != "cpu") or lane.busy():
            # device tensors may be in it: decode off the I/O thread, in order (``_lane``)
            try:
                lane.submit(self._handle_notification, conn, frame)
            except RuntimeError:  # stopped: as a notification for a stopped agent
                pass
            return
        self._handle_notification(conn, frame)

    def _handle_notification(self, conn: Link, frame: Frame) -> None:
        try:
            func, args = loads(frame.meta, frame.buffers, frame.flags)
            guard = _choice.state.guard  # (an attribute read: no call per message)
            if guard is not None:  # the allow-list: one-way messages are distgrad's own
                guard.check_call(func)
        except BaseException as exc:
            if Process.seen:
                take_arrivals()  # a decode that failed halfway: forget what it put on devices
            if isinstance(exc, RefusedError):
                self._stats.refused(conn.peer)
            _log.warning(
                "dropped a notification from %s: cannot unpickle it: %r", conn.peer_label, exc
            )
            return
        if Process.seen:  # a device tensor arrived (ever): settle this message's on the host
            self._codec.backend.settle(take_arrivals())
        if getattr(func, "_distgrad_on_io_thread", False):
            self._run_notification(func, args)
        elif self._shared.stopped:
            return
        elif getattr(func, "_distgrad_after_current", False):
            if self._here.lingering:
                # read by a worker lingering between two requests: that is "after the current
                # task", on this thread, with no other thread woken for it
                self._run_notification(func, args)
            else:
                self._workers.submit_after_current(self._run_notification, func, args)
        else:
            self._workers.submit(self._run_notification, func, args)

    @staticmethod
    def _run_notification(func: Any, args: tuple[Any, ...]) -> None:
        try:
            func(*args)
        except BaseException:
            _log.exception("unhandled error in the notification handler %r", func)

    # -- serve: decode -> wait until its references are usable -> run -> reply (worker threads) --
    def _serve_timed(self, conn: Link, frame: Frame, arrived: float) -> None:
        """:meth:`_serve`, counting the wait since ``arrived`` (``enable_gil_profiling``)."""
        waited = time.perf_counter() - arrived
        with self._lock:
            self.gil_wait[0] += waited
            self.gil_wait[1] += 1
        self._serve(conn, frame)

    def _serve_and_linger(self, conn: Link, frame: Frame) -> None:
        """:meth:`_serve`, then, while the pool has nothing waiting, linger on ``conn`` for
        the peer's next request and serve it on this thread: a peer calling again at once
        wakes this worker only (``Connection.serve_lingering``)."""
        linger = getattr(conn, "serve_lingering", None)
        if linger is None:
            self._serve(conn, frame)
            return
        pool = self._workers
        here = self._here
        while True:
            # the read role is taken as soon as the reply went out (_write), so that the
            # peer's next request rarely reaches the I/O thread first
            here.hold = conn
            try:
                self._serve(conn, frame)
            except BaseException:
                if here.held:
                    conn.release_read()  # type: ignore[attr-defined]
                raise
            finally:
                here.hold = None
                held, here.held = here.held, False
            if self._shared.stopped or not pool.linger_start():
                if held:
                    conn.release_read()  # type: ignore[attr-defined]
                return
            here.lingering = True
            try:
                taken = linger(held=held)  # the next request, read on this thread
            finally:
                here.lingering = False
                pool.linger_end()
            if taken is None:
                return
            if self.gil_profiling or self._shared.stopped:  # as if the I/O thread had read
                self.on_request(conn, taken)  # it: timed, or refused by a stopped pool
                return
            frame = taken

    def _serve(self, conn: Link, frame: Frame) -> None:
        flags = frame.flags
        if (
            flags & _LEAN_FLAGS
            and not flags & HAS_TABLE
            and choice.unpickler is None
            and not self._shared.describe
        ):
            # The lean path (issue 28). Preconditions: a request flagged ``PLAIN`` (plain
            # pickle of atoms and functions) or ``LEAN`` (the same with CPU tensors) -- no
            # table, so no recording; no reference, so none to collect or wait for, and no
            # ``remote()`` creation --, the default unpickler (no allow-list: a guard always
            # comes with its own), replies not described (fault injection). It runs as the
            # general path below would, without the steps such a request has no use for
            # (should a peer's frame put tensors on a device anyway, they are served there).
            buffers = frame.buffers
            size = len(frame.meta)
            for buffer in buffers:
                size += buffer.nbytes
            self._stats.request(conn.peer, size)
            try:
                lean = _loads(frame.meta, buffers=buffers)
                func, args, kwargs = lean[0], lean[1], lean[2]
            except BaseException as exc:
                if Process.seen:
                    take_arrivals()  # a decode that failed halfway: forget what it put there
                self._reply_error(conn, frame.message_id, self._unpickling_error(exc, conn))
                return
            arrivals = take_arrivals() if Process.seen else None
            if buffers:
                del buffers[:]  # (the tensors hold their memory; the frame lets go of it)
            if len(lean) > 3:  # a traced call
                self._serve_traced(conn, frame, lean[3], func, args, kwargs, None, arrivals)
            elif arrivals is not None:
                self._serve_on_devices(conn, frame, func, args, kwargs, None, arrivals)
            else:
                self._run(conn, frame, func, args, kwargs, None)
            return
        size = len(frame.meta)
        for buffer in frame.buffers:
            size += buffer.nbytes
        self._stats.request(conn.peer, size)
        extension = _layer._recorder  # (the registry's field: no call on the call path)
        states: list[int | None] = []

        def on_table(ext: Any, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
            assert extension is not None
            tensors, state = extension.incoming_request(conn.peer, ext, tensors)
            states.append(state)
            return tensors

        references = _layer._references  # (the registry's field: no call on the call path)
        previous = references.start_collecting() if references is not None else None
        request: Any = ()
        try:
            _ext, request = decode(
                frame.meta, frame.buffers, frame.flags, on_table if extension else None
            )
            func, args, kwargs = request[0], request[1], request[2]
        except BaseException as exc:
            unrun: BaseException | None = self._unpickling_error(exc, conn)
        else:
            unrun = None
            guard = _choice.state.guard  # (an attribute read: no call per request)
            if guard is not None:  # the allow-list: may a peer run this function here?
                try:
                    guard.check_call(func)
                except RefusedError as exc:
                    self._stats.refused(conn.peer)
                    unrun = exc
        finally:
            collected = references.stop_collecting(previous) if references is not None else None
            arrivals = take_arrivals() if Process.seen else None
        if self._shared.describe and unrun is None:  # replies go out described (fault injection)
            wrapped = bool(states) and states[0] is not None
            conn = _ReplyLink(conn, describe_request(func, args, wrapped=wrapped))
        if unrun is None and collected:  # RRefs in the arguments: run once owners know them
            assert references is not None
            try:
                timeout = self._shared.rpc_timeout if self._shared.rpc_timeout > 0 else None
                with self._blocking():
                    references.wait_usable(collected, timeout)
            except BaseException as exc:
                unrun = exc
        if unrun is not None:
            # Failed before the function ran. A remote() creation's error is its value's (as
            # if the function had raised it), and the creation is answered: a to_here()
            # already on its way raises it instead of waiting for a value never set.
            if references is not None and references.fail_unrun(self._agent, unrun):
                self._reply(conn, frame.message_id, None, None)
            else:
                self._reply_error(conn, frame.message_id, unrun)
            return
        del frame.buffers[:]
        state = states[0] if states else None
        if len(request) > 3:  # a traced call: its span here, the caller's its parent
            self._serve_traced(conn, frame, request[3], func, args, kwargs, state, arrivals)
            return
        if arrivals is not None:
            self._serve_on_devices(conn, frame, func, args, kwargs, state, arrivals)
            return
        self._run(conn, frame, func, args, kwargs, state)

    def _unpickling_error(self, exc: BaseException, conn: Link) -> BaseException:
        """What a request that could not be unpickled is answered with (``exc``: why)."""
        if isinstance(exc, RefusedError):  # the allow-list: the error names what and why
            self._stats.refused(conn.peer)
            return exc
        if isinstance(exc, (AttributeError, ImportError)):
            error = RuntimeError(f"{UDF_MISSING} ({exc!r})")
            report_udf_error(error, str(self._shared.worker_info))
            return error
        return RuntimeError(f"could not unpickle the request: {exc!r}")

    def _serve_traced(
        self,
        conn: Link,
        frame: Frame,
        header: object,
        func: Any,
        args: Any,
        kwargs: Any,
        state: int | None,
        arrivals: Arrivals | None,
    ) -> None:
        """Run a request that came with a ``traceparent`` in its span (``_tracing``): the
        calls it makes are its children. (An ``@async_execution`` function's span ends when
        it returns its future.)"""
        span = _tracing.server(
            header, self._shared.worker_info.name, conn.peer_label, function_label(func)
        )
        previous = _tracing.set_current(span)
        try:
            if arrivals is not None:
                self._serve_on_devices(conn, frame, func, args, kwargs, state, arrivals)
            else:
                self._run(conn, frame, func, args, kwargs, state)
        finally:
            _tracing.set_current(previous)
            if span is not None:
                span.end()

    def _serve_on_devices(
        self,
        conn: Link,
        frame: Frame,
        func: Any,
        args: Any,
        kwargs: Any,
        state: int | None,
        arrivals: Arrivals,
    ) -> None:
        """Run a request whose tensors arrived on devices: a user function runs (and its reply
        is staged) under the streams that carried them, as torch's callee; distgrad's own
        handlers may hand values to other threads, so those wait on the host first."""
        backend = self._codec.backend
        if getattr(func, "__module__", "").startswith("distgrad."):
            backend.settle(arrivals)
            self._run(conn, frame, func, args, kwargs, state)
            return
        with backend.running_under(arrivals):
            self._run(conn, frame, func, args, kwargs, state, arrivals)

    def _run(
        self,
        conn: Link,
        frame: Frame,
        func: Any,
        args: Any,
        kwargs: Any,
        state: int | None,
        arrivals: Arrivals | None = None,
    ) -> None:
        extension = _layer._recorder  # (the registry's field: no call on the call path)
        run = func
        wrap = _profiling.serving_wrapper  # rpc._server_process_global_profile is open
        if wrap is not None:
            run = wrap(func)
        try:
            if state is None:
                if getattr(func, "_wrapped_async_rpc_function", None) is not None:
                    self._serve_async(conn, frame.message_id, run, args, kwargs, None, arrivals)
                    return
                result = run(*args, **(kwargs or {}))
            else:
                assert extension is not None
                with extension.scope(state):
                    if getattr(func, "_wrapped_async_rpc_function", None) is not None:
                        self._serve_async(
                            conn, frame.message_id, run, args, kwargs, state, arrivals
                        )
                        return
                    result = run(*args, **(kwargs or {}))
        except BaseException as exc:
            # builtin operators' and TorchScript functions' errors keep their bare message;
            # TorchScript's own (torch.jit.Error) arrive as RuntimeError, as torch's do
            builtin = is_builtin(func)
            if is_script_function(func):
                builtin = True
                if not isinstance(exc, RuntimeError):
                    exc = RuntimeError(str(exc))
            if not builtin:  # as the reference's callee: a Python function's error is printed
                report_udf_error(exc, str(self._shared.worker_info))
            self._reply_error(conn, frame.message_id, exc, builtin=builtin)
            return
        self._reply(conn, frame.message_id, result, state)

    def _serve_async(
        self,
        conn: Link,
        message_id: int,
        func: Any,
        args: Any,
        kwargs: Any,
        state: int | None,
        arrivals: Arrivals | None = None,
    ) -> None:
        future = check_async_result(func(*args, **(kwargs or {})))
        with self._lock:
            self.serving_async += 1

        def respond(done: torch.futures.Future[Any]) -> None:
            with self._lock:
                self.serving_async -= 1
            if arrivals is not None:  # the reply is staged after the request's device work
                self._codec.backend.join_current(arrivals)
            try:
                result = done.value()
            except BaseException as exc:
                self._reply_error(conn, message_id, exc)
                return
            self._reply(conn, message_id, result, state)

        future.add_done_callback(respond)

    # -- reply -----------------------------------------------------------------------------------
    def _reply(self, conn: Link, message_id: int, result: Any, state: int | None) -> None:
        extension = _layer._recorder  # (the registry's field: no call on the call path)
        peer = conn.peer
        if (state is None or extension is None) and choice.picklers is None and is_plain(result):
            # (lean: a plain result -- no tensor, so nothing to route or record -- is what
            # encode() would make of it: plain pickle)
            try:
                meta = _dumps(result, 5)
                if len(meta) > self._codec.least_limit:
                    self._codec.check_bytes(len(meta), peer)
            except BaseException as exc:
                self._reply_error(conn, message_id, exc)
                return
            self._write(conn, Kind.RESPONSE, message_id, meta)
            return
        check = self._codec.device_check("Response", peer)
        if state is None or extension is None:
            try:
                encoded = encode(result, device_check=check)
                self._codec.check_size(encoded, peer)
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
                self._codec.check_size(encoded, peer)
            except BaseException as exc:
                self._reply_error(conn, message_id, exc)
                return
            flags = encoded.flags
            self._write(conn, Kind.RESPONSE, message_id, encoded.meta, encoded.buffers, flags)
        finally:
            extension.sent()

    def _reply_error(
        self, conn: Link, message_id: int, exc: BaseException, *, builtin: bool = False
    ) -> None:
        payload = error_payload(exc, str(self._shared.worker_info), builtin)
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
        if self._shared.silenced:
            _log.debug(
                "not sending the response to request #%d to %s: RPC is shutting down without grace",
                message_id,
                conn.peer_label,
            )
            return
        size = len(meta)
        if buffers:
            for buffer in buffers:  # (a loop: a generator costs more for one or two)
                size += buffer.raw().nbytes
        self._stats.replied(conn.peer, size, failed=kind == Kind.ERROR)
        try:
            conn.send_frame(kind, message_id, meta, buffers, flags)
        except DistgradError as exc:
            _log.debug("not sending a response to %s: %s", conn.peer_label, exc)
        here = self._here
        if here.hold is conn and not here.held and not self._workers.waiting():
            # a worker about to linger on conn (unless work waits for it: then it will not,
            # and taking the role would cost two system calls for nothing). Taken right after
            # the reply, before the GIL may go to a thread the request released -- a follower
            # leaving a barrier -- so the reply is out first.
            here.held = conn.hold_read()  # type: ignore[attr-defined]


class _Here(threading.local):
    """Per thread: a worker about to linger, or lingering, on the connection it serves."""

    #: it lingers (between two requests: a notification it reads and hands on runs there)
    lingering: bool = False

    #: the connection whose read role the reply about to be written takes, and whether it did
    hold: object = None
    held: bool = False


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
