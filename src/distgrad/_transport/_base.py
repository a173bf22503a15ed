"""The transport contract: what the RPC layer needs from whatever moves frames between workers.

Three transports implement it: sockets (``_transport.SocketTransport``, the real one), memory
(``_inmemory.MemoryTransport``: several agents in one process, for fast tests) and a
fault-injecting wrapper around either (``_faulty.FaultyTransport``). The RPC agent knows only
this module; it never touches a socket.

The contract, in the order of a worker's life:

* a factory (:class:`TransportFactory`) builds the transport for one agent, given its
  configuration, its I/O thread and the :class:`FrameHandler` that frames go to;
* :meth:`Transport.listen` opens it and returns the :class:`PeerAddress` to publish;
  :meth:`Transport.set_peers` gives it everyone's address after the rendezvous;
* :meth:`Transport.connection` returns the :class:`Link` to a peer, opened on first use (a
  blocking call, on the sending thread); ``Link.send_frame`` writes one frame from any thread;
* frames arrive on the I/O thread, at ``FrameHandler.on_frame``, each with the link it came on
  (a response goes back on the link its request came on);
* a link that breaks is reported once, at ``FrameHandler.on_connection_lost``, with the error to
  give whatever waited on it and whether the peer is now known dead (every later send to a dead
  peer fails at once); a protocol error drops the link without condemning the peer;
* :meth:`Transport.close` ends it (gracefully: goodbyes sent and queues flushed first);
  :meth:`Transport.statistics` is a snapshot of its counters at any time.

Message descriptions: a transport that sets ``wants_message_info`` (the fault injector) gets a
:class:`MessageInfo` with every frame the agent sends -- the message's type, the function it
calls -- so that it can pick messages by what they mean. Other transports never see one, and
the agent does not build them.
"""

from __future__ import annotations

import pickle
import ssl
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from .._errors import DistgradError
from .._wire._frames import Frame

if TYPE_CHECKING:
    from ._io import IoThread

__all__ = [
    "FrameHandler",
    "Link",
    "MessageInfo",
    "Pausable",
    "PeerAddress",
    "Severable",
    "Transport",
    "TransportConfig",
    "TransportFactory",
    "TransportStatistics",
]


@dataclass(frozen=True, slots=True)
class PeerAddress:
    """Where a worker listens (published through the rendezvous store)."""

    host: str
    port: int
    unix: str | None
    host_id: str
    #: the largest message the worker accepts (0: not published)
    max_message_size: int = 0
    #: whether its TCP connections use TLS
    tls: bool = False
    #: the random id of this start of the worker (0: not known); a worker relaunched under
    #: the same rank has another, and peers take the old one for dead
    incarnation: int = 0


@dataclass(frozen=True, slots=True)
class TransportConfig:
    rank: int
    world_size: int
    secret: bytes
    max_message_size: int
    heartbeat_interval: float
    peer_timeout: float
    handshake_timeout: float
    connect_timeout: float
    use_unix_sockets: bool = True
    server_ssl: ssl.SSLContext | None = None
    client_ssl: ssl.SSLContext | None = None
    #: any lost connection proves the peer dead (no suspicion, no reconnection)
    fail_stop: bool = False
    #: this start's random id, presented in every handshake (0: none)
    incarnation: int = 0
    #: members join and leave (a dynamic group): peers of any rank may connect
    dynamic: bool = False


@dataclass(frozen=True, slots=True)
class TransportStatistics:
    """A snapshot of the transport's counters (for tests, debugging and monitoring)."""

    open_connections: int
    connections_accepted: int
    connections_opened: int
    handshakes_failed: int
    protocol_errors: int
    dead_peers: tuple[int, ...]
    #: tensor bytes this worker read straight from peers' memory (same host), not the socket
    bytes_read_directly: int = 0
    #: tensor bytes this worker took out of peers' shared-memory rings (same host)
    bytes_through_ring: int = 0
    #: bytes of peers' rings this process's received tensors hold now (their storage lent
    #: from the ring, freed as they die)
    ring_bytes_lent: int = 0
    #: heartbeat ticks that found this process itself had not been running for more than a
    #: heartbeat interval (and so judged no peer's silence)
    stalls: int = 0
    #: the verdicts given on peers: ``(rank, kind, cause, count)`` -- kinds ``suspected``,
    #: ``dead``, ``recovered``, ``restarted`` (see ``_suspicion.PeerVerdicts``)
    peer_events: tuple[tuple[int, str, str, int], ...] = ()


@dataclass(frozen=True, slots=True)
class MessageInfo:
    """What a frame means, for transports that choose frames by it (fault injection).

    ``type`` is torch's message type name where there is one (``PYTHON_CALL``,
    ``RREF_FORK_REQUEST``, ``BACKWARD_AUTOGRAD_REQ``, ``PYTHON_RET``, ``EXCEPTION`` ...);
    ``wrapper`` the type of torch's message around it, if any (``FORWARD_AUTOGRAD_REQ`` for a
    call that distributed autograd records); ``function`` the qualified name of the function
    the request calls (for a response: its request's); ``request`` is False for responses."""

    type: str
    function: str
    request: bool = True
    wrapper: str | None = None


class Link(Protocol):
    """One connection to a peer, as the RPC layer sees it. ``send_frame`` may be called from any
    thread; frames on one link arrive in the order they were sent."""

    peer: int
    peer_label: str

    @property
    def closed(self) -> bool: ...

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
        """Write one frame, or raise a :class:`DistgradError` saying why it cannot be sent."""
        ...

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
        """Queue a frame nothing waits for: it goes out after the next frame written on this
        link, or within a heartbeat interval; lost if the link breaks first."""
        ...

    def broken_error(self) -> DistgradError:
        """The error for a send on (or a wait for) this link once it is closed."""
        ...

    def close(self, error: Exception | None = None) -> None:
        """Close now (any thread); ``error`` says why (``None``: an orderly close)."""
        ...


class FrameHandler(Protocol):
    """What a transport calls (the RPC agent implements it); on the I/O thread, except as
    :meth:`on_frame` says."""

    def on_frame(self, link: Link, frame: Frame) -> None:
        """A frame arrived, handed on by the thread that read it: the I/O thread, or (the
        socket transport's plain connections) a caller reading its own answer or a worker
        lingering for its peer's next request -- which hands on requests only; every other
        frame it reads goes to the I/O thread, in order."""

    def on_connection_lost(self, link: Link, error: Exception, *, peer_dead: bool) -> None: ...


class Transport(Protocol):
    """The links of one worker to its peers; owned and closed by its RPC agent."""

    #: True if the transport wants a :class:`MessageInfo` with every frame sent
    wants_message_info: bool

    def listen(self, host: str) -> PeerAddress:
        """Start accepting connections; return the address to publish."""
        ...

    def set_peers(self, peers: Mapping[int, PeerAddress]) -> None:
        """Everyone's address, after the rendezvous."""
        ...

    def add_peer(self, rank: int, address: PeerAddress) -> None:
        """A member joined (or rejoined): its address. An address with another incarnation
        than the one known for ``rank`` proves the old incarnation dead: its links close
        with an error naming it, and the new one is reachable (no longer dead or suspected)."""
        ...

    def remove_peer(self, rank: int, error: Exception) -> None:
        """A member left the group: every later send to it fails at once with ``error``."""
        ...

    def connection(self, rank: int) -> Link:
        """The link for sending to ``rank``, opened (blocking) on first use."""
        ...

    def open_link(self, rank: int) -> Link | None:
        """The link for sending to ``rank`` if one is open now, else ``None``; never dials and
        never waits (the I/O thread uses it: a dial there would stop every connection's
        reads while the handshake waits for a peer that may itself wait on this worker)."""
        ...

    def is_dead(self, rank: int) -> bool:
        """True once ``rank`` is known to be dead (every later send to it fails)."""
        ...

    def is_suspected(self, rank: int) -> bool:
        """True while ``rank`` is suspected: its last connection was lost without proof of
        death and no new one was opened since."""
        ...

    def check_alive(self, rank: int) -> None:
        """Raise the peer's failure if it is known to be dead."""
        ...

    def close(self, graceful: bool) -> None:
        """Close every link; with ``graceful``, say goodbye and flush first."""
        ...

    def statistics(self) -> TransportStatistics: ...


@runtime_checkable
class Severable(Protocol):
    """A transport that can cut its links to one peer (for fault injection)."""

    def sever(self, rank: int) -> None:
        """Close every link with ``rank`` abruptly: each side sees the other die."""
        ...


@runtime_checkable
class Pausable(Protocol):
    """A transport that can be frozen (for fault injection)."""

    def pause(self) -> None:
        """Stop receiving, sending and heartbeating -- as a stopped process -- until resumed."""
        ...

    def resume(self) -> None: ...


class TransportFactory(Protocol):
    """Builds one agent's transport."""

    def __call__(
        self,
        config: TransportConfig,
        io: IoThread,
        handler: FrameHandler,
        peer_label: Callable[[int], str],
    ) -> Transport: ...
