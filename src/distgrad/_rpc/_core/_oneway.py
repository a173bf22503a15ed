"""One-way messages out: a part of the agent (:class:`OneWay`). ``notify`` (a ``NOTIFY`` frame,
never answered), ``post`` (the same for a message nothing waits for, never blocking its
caller: a send that needs a dial goes to the agent's dialing threads, ``_dialer``), and
``send_with_retries`` (an idempotent internal request, retried, the reference's
``sendWithRetries``). On the I/O thread nothing here ever dials.

:class:`OneWay` is a stage of :class:`~distgrad._rpc._core._agent.RpcAgent`, given what it uses
(the agent's running state, ``_shared``; the outgoing stage, for retried requests)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from ..._devices._maps import DeviceMap
from ..._errors import (
    DistgradError,
    FrameNotSentError,
    PeerFailureError,
    RpcShutdownError,
)
from ..._transport._io import IoThread
from ..._wire._frames import Kind
from ..._wire._pickler import encode
from ._calls import set_future_error
from ._codec import Codec
from ._dialer import Dialer
from ._messages import describe_request
from ._outgoing import Outgoing
from ._pool import ThreadPool
from ._shared import Shared
from ._worker_info import WorkerInfo

__all__ = ["RETRY_ATTEMPTS", "OneWay"]

_log = logging.getLogger("distgrad.rpc")

RETRY_ATTEMPTS = 5  # of idempotent internal messages (torch's RpcRetryOptions: 5)
_RETRY_BACKOFF = 0.05  # seconds before the first retry; doubles each time
_SUSPECTED_RETRY = 0.5  # seconds between attempts while the peer is suspected


class OneWay:
    """One-way messages and retried internal requests: a stage of the agent, which makes it
    and hands it what it uses (retried requests are calls of the outgoing stage)."""

    def __init__(
        self,
        shared: Shared,
        *,
        codec: Codec,
        io: IoThread,
        dialer: Dialer,
        callbacks: ThreadPool,
        outgoing: Outgoing,
        lookup: Callable[[int], WorkerInfo],
        incarnation_of: Callable[[int], int],
    ) -> None:
        self._shared = shared
        self._codec = codec
        self._io = io
        #: the threads that dial for sends that must not wait (``_dialer``)
        self._dialer = dialer
        #: where retries are made (an attempt may block: never on the I/O thread)
        self._callbacks = callbacks
        self._outgoing = outgoing
        #: the worker of a rank (the agent's ``get_worker_info``)
        self._lookup = lookup
        #: the incarnation known for a rank (the agent's ``incarnation_of``)
        self._incarnation_of = incarnation_of

    def notify(
        self,
        dst: int,
        func: Any,
        args: tuple[Any, ...],
        *,
        later: bool = False,
        device_map: DeviceMap | None = None,
    ) -> None:
        """Send a one-way internal message: the receiver runs ``func(*args)`` and answers
        nothing (an error there is logged there). The layer above learns of a lost peer through
        the agent's failure detection, not through this call. Raises if it cannot be sent.

        With ``later``, the message goes out with this worker's next write to ``dst`` (after
        that write's frame), or at the latest with the next heartbeat tick
        (``heartbeat_interval``): for messages nothing waits for, which then cost no write and
        no wake-up of the peer of their own. Such a message is lost if the connection fails
        before it went out. ``device_map`` as for ``call_internal``.

        On the I/O thread it never dials (see ``_dialer``): with no connection open to ``dst``,
        the message is sent by ``dst``'s dialing thread once it has connected (and a failure
        there is only logged)."""
        if self._shared.state.stopped:
            raise self._shared.stopped_error("NOTIFY")
        if not self._io.in_loop():
            self._notify(dst, func, args, later, device_map=device_map)
            return
        if self._writable_now(dst):
            try:
                self._notify(dst, func, args, later, redial=False, device_map=device_map)
                return
            except FrameNotSentError:
                pass  # (the connection broke: a new one is dialed off this thread)
        self._dialer.submit(dst, lambda: self._notify_logged(dst, func, args, 1, device_map))

    def post(
        self, dst: int, func: Any, args: tuple[Any, ...], *, later: bool = False, attempts: int = 1
    ) -> None:
        """:meth:`notify` for a message nothing waits for, from any thread, without ever
        blocking the caller: written now if a connection to ``dst`` is open, else (or if that
        write finds the connection broken) sent by ``dst``'s dialing thread, which connects
        first and tries ``attempts`` times in all while connections break (never to a peer
        proved dead). Raises nothing: a message that cannot be delivered is logged (debug)."""
        if self._shared.state.stopped:
            return
        if self._writable_now(dst):
            try:
                self._notify(dst, func, args, later, redial=False)
                return
            except RpcShutdownError:
                return
            except FrameNotSentError:
                pass  # (not sent: the dialing thread sends it on a new connection)
            except DistgradError as exc:
                if attempts <= 1 or self._shared.peer_is_dead(dst):
                    _log.debug("one-way %s to %s not sent: %s", func, dst, exc)
                    return
                attempts -= 1
        self._dialer.submit(dst, lambda: self._notify_logged(dst, func, args, attempts))

    def _writable_now(self, dst: int) -> bool:
        """Whether a message to ``dst`` can be written without dialing or waiting (a connection
        is open and nothing queued for ``dst`` waits for a dial)."""
        if self._dialer.busy(dst):
            return False
        if dst == self._shared.worker_info.id:
            return True  # (the connection to this worker itself never waits)
        assert self._shared.transport is not None
        return self._shared.transport.open_link(dst) is not None

    def _notify_logged(
        self,
        dst: int,
        func: Any,
        args: tuple[Any, ...],
        attempts: int,
        device_map: DeviceMap | None = None,
    ) -> None:
        """Send now, dialing if needed, ``attempts`` times while connections break (a dialing
        thread's part of :meth:`notify` and :meth:`post`)."""
        for attempt in range(attempts):
            if self._shared.state.stopped:
                return
            try:
                self._notify(dst, func, args, False, device_map=device_map)
                return
            except RpcShutdownError:
                return
            except DistgradError as exc:
                if attempt + 1 == attempts or self._shared.peer_is_dead(dst):
                    _log.debug("one-way %s to %s not sent: %s", func, dst, exc)
                    return

    def _notify(
        self,
        dst: int,
        func: Any,
        args: tuple[Any, ...],
        later: bool,
        *,
        redial: bool = True,
        device_map: DeviceMap | None = None,
    ) -> None:
        """Write the message on the connection to ``dst`` (dialed if none is open). A frame
        found not sent (a broken connection) goes once more on a new one -- unless not
        ``redial``: the ``FrameNotSentError`` is raised then."""
        if self._shared.state.stopped:
            raise self._shared.stopped_error("NOTIFY")
        assert self._shared.transport is not None
        conn = self._shared.transport.connection(dst)
        encoded = encode(
            (func, args), device_check=self._codec.device_check("Request", dst, device_map)
        )
        self._codec.check_size(encoded, dst)
        info = describe_request(func, args, wrapped=False) if self._shared.describe else None
        if later:
            conn.send_frame_later(
                Kind.NOTIFY, 0, encoded.meta, encoded.buffers, encoded.flags, info=info
            )
            return
        try:
            conn.send_frame(Kind.NOTIFY, 0, encoded.meta, encoded.buffers, encoded.flags, info=info)
        except FrameNotSentError:  # not sent at all: once more, on a fresh connection
            if not redial:
                raise
            conn = self._shared.transport.connection(dst)
            conn.send_frame(Kind.NOTIFY, 0, encoded.meta, encoded.buffers, encoded.flags, info=info)

    def send_with_retries(
        self, dst: int, func: Any, args: tuple[Any, ...], attempts: int = RETRY_ATTEMPTS
    ) -> torch.futures.Future[Any]:
        """An internal message whose handler is idempotent (the reference's
        ``sendWithRetries``): a failure other than a dead peer or a stopped agent -- a timeout
        (each attempt has the default RPC timeout) included -- is retried, after a pause that
        doubles each time (``_RETRY_BACKOFF``), ``attempts`` times in all. A peer that is only
        *suspected* (silent, or its connection lost without proof of death) is tried again
        for as long as it stays so, at most every ``_SUSPECTED_RETRY`` seconds and without
        counting those attempts: what it missed reaches it when it is back (a partition that
        heals), and the retries end when it is proved dead or this agent stops. The future
        completes with the result or the last error."""
        result: torch.futures.Future[Any] = torch.futures.Future()
        incarnation = self._incarnation_of(dst)

        def failed(exc: BaseException, left: int) -> None:
            if isinstance(exc, RpcShutdownError) or self._shared.state.stopped:
                set_future_error(result, exc)
                return
            if isinstance(exc, PeerFailureError):
                transport = self._shared.transport
                if (
                    transport is None
                    or transport.is_dead(dst)
                    or self._incarnation_of(dst) != incarnation  # never to its successor
                ):
                    set_future_error(result, exc)
                    return
                left += 1  # suspected: this attempt does not count
                pause = _SUSPECTED_RETRY
            elif left <= 1:
                set_future_error(result, exc)
                return
            else:
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
                future = self._outgoing.call_async(self._lookup(dst), func, args, {}, internal=True)
            except PeerFailureError as exc:  # gone, or suspected and not reachable now
                failed(exc, left)
                return
            except BaseException as exc:  # this agent stops, bad arguments
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
