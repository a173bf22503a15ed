"""distgrad's exception tree.

Every error distgrad raises on its own account derives from :class:`DistgradError`, which is a
``RuntimeError`` so that code written for torch's RPC (``except RuntimeError``, ``pytest.raises(
RuntimeError, match=...)``) keeps catching what it caught before. The branches follow causes:

* :class:`RpcTimeoutError` -- a call ran past its deadline (message as torch's ``RPCErr:1:...``);
  also a ``TimeoutError``, so ``except TimeoutError`` catches it too.
* :class:`PeerFailureError` -- the other side died or went away (broken, not closed by us).
* :class:`RpcShutdownError` -- this worker's agent is shut down (closed by us).
* :class:`InjectedFailureError` -- a send that fault injection failed on purpose (tests only;
  torch's ``RPCErr:2:Send attempt failed intentionally ...``).
* :class:`ProtocolError` -- bytes from a socket broke the wire protocol; :class:`HandshakeError`
  and :class:`MessageTooLargeError` are its kinds. A malformed frame from a connected peer stays
  in the transport: it drops that one connection and is logged, and the calls waiting on the
  connection fail with :class:`PeerFailureError`. Two kinds reach the caller: a
  :class:`MessageTooLargeError` when a request or response is above the sender's or the
  receiver's ``max_message_size`` (refused before it is sent), and a :class:`HandshakeError`
  when the connection a call needs fails the authenticated handshake.

The classes are re-exported by ``distgrad.rpc`` (``BackwardError`` by ``distgrad.autograd``),
which rewrites their ``__module__`` so that tracebacks show the public name.

Exceptions raised by user functions on a remote worker are re-raised on the caller with their
original type (see ``distgrad._rpc._core._remote_error``), not wrapped in this tree.
"""

from __future__ import annotations


class DistgradError(RuntimeError):
    """Base class of every error distgrad raises on its own account; a ``RuntimeError``, so
    code written for torch's RPC (``except RuntimeError``) catches it as before.

    Example:
        try:
            rpc.rpc_sync("worker1", work, args=(x,), timeout=5)
        except rpc.RpcTimeoutError:
            ...  # slow: retry later
        except rpc.PeerFailureError as err:
            ...  # err.peer is gone
        except rpc.DistgradError:
            ...  # any other failure of distgrad itself
    """


class RpcTimeoutError(DistgradError, TimeoutError):
    """An RPC did not complete within its timeout: a ``RuntimeError`` (what torch raises and
    its callers catch) and a ``TimeoutError``."""


class PeerFailureError(DistgradError):
    """A peer died, became unreachable, or shut down while a call depended on it.

    Raised by calls, backward passes, RRef operations and group operations that wait on that
    peer, within the failure-detection bound (``peer_timeout``, 4 s by default), and at once
    by later calls to a peer known to be dead; the message names the peer.

    Attributes:
        peer (str, optional): the peer, as ``"worker worker1 (rank 1)"``.
    """

    def __init__(self, message: str, peer: str | None = None) -> None:
        super().__init__(message)
        self.peer = peer


class FrameNotSentError(PeerFailureError):
    """Internal (never reaches a caller as such): a frame could not be written at all -- its
    connection was found dead (EPIPE, ECONNRESET, already closed) before any byte of the frame
    reached the kernel -- so the peer cannot have received it. ``Connection.send`` raises it,
    having marked the connection closed; the RPC layer sends a request that failed so once
    more, on a fresh connection."""


#: appended to the error of a call that failed because its connection was lost after its
#: request was (possibly) written
MAYBE_RUN = " (the peer may not have received the request, or may have run it)"


class RpcShutdownError(DistgradError):
    """The local RPC agent is shut down or shutting down: calls still waiting when
    ``shutdown(graceful=False)`` ran fail with it ("RPC agent was shut down before the call
    completed"), and so do requests that reach a worker after it stopped serving."""


class InjectedFailureError(DistgradError):
    """A send failed on purpose: fault injection (``FAULTY_TENSORPIPE``, ``distgrad.testing``)."""


class ProtocolError(DistgradError):
    """Data read from a connection violates the wire protocol. A malformed frame drops that
    connection only (logged; the calls waiting on it fail with ``PeerFailureError``); the two
    subclasses reach the caller of an RPC."""


class HandshakeError(ProtocolError):
    """A connection failed the authenticated handshake: the peer does not use the same
    cluster secret, or speaks another version of the wire protocol. Raised by the call that
    needed the connection, e.g. "handshake with worker worker1 (rank 1) failed: peer failed
    authentication (does it use the same cluster secret?)"."""


class MessageTooLargeError(ProtocolError):
    """A message is above the maximum message size (``max_message_size`` of this worker or
    of the receiver): the call fails before anything is sent, with "message of N bytes
    exceeds the maximum message size of M bytes (TensorPipeRpcBackendOptions(
    max_message_size=...))"; a response that is too large reaches its caller as this error.
    The connection stays usable."""


def rpc_timeout_message(timeout_s: float) -> str:
    """The reference's exact timeout message (callers match ``"RPC ran for more than"``)."""
    return (
        f"RPCErr:1:RPC ran for more than set timeout ({round(timeout_s * 1000)} ms) "
        "and will now be marked with an error"
    )
