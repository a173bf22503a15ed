"""distgrad's exception tree.

Every error distgrad raises on its own account derives from :class:`DistgradError`, which is a
``RuntimeError`` so that code written for torch's RPC (``except RuntimeError``, ``pytest.raises(
RuntimeError, match=...)``) keeps catching what it caught before. The branches follow causes:

* :class:`RpcTimeoutError` -- a call ran past its deadline (message as torch's ``RPCErr:1:...``).
* :class:`PeerFailureError` -- the other side died or went away (broken, not closed by us).
* :class:`RpcShutdownError` -- this worker's agent is shut down (closed by us).
* :class:`InjectedFailureError` -- a send that fault injection failed on purpose (tests only;
  torch's ``RPCErr:2:Send attempt failed intentionally ...``).
* :class:`ProtocolError` -- bytes from a socket broke the wire protocol; :class:`HandshakeError`
  and :class:`MessageTooLargeError` are its kinds. These never escape to user code: they drop
  one connection and are logged.

Exceptions raised by user functions on a remote worker are re-raised on the caller with their
original type (see ``distgrad._rpc._remote_error``), not wrapped in this tree.
"""

from __future__ import annotations


class DistgradError(RuntimeError):
    """Base class of every error distgrad raises on its own account."""


class RpcTimeoutError(DistgradError):
    """An RPC did not complete within its timeout."""


class PeerFailureError(DistgradError):
    """A peer died, became unreachable, or shut down while a call depended on it."""

    def __init__(self, message: str, peer: str | None = None) -> None:
        super().__init__(message)
        self.peer = peer


class RpcShutdownError(DistgradError):
    """The local RPC agent is shut down or shutting down."""


class InjectedFailureError(DistgradError):
    """A send failed on purpose: fault injection (``FAULTY_TENSORPIPE``, ``distgrad.testing``)."""


class ProtocolError(DistgradError):
    """Data read from a connection violates the wire protocol."""


class HandshakeError(ProtocolError):
    """A connection failed the authenticated handshake."""


class MessageTooLargeError(ProtocolError):
    """A frame announced a size above the configured maximum message size."""


def rpc_timeout_message(timeout_s: float) -> str:
    """The reference's exact timeout message (callers match ``"RPC ran for more than"``)."""
    return (
        f"RPCErr:1:RPC ran for more than set timeout ({round(timeout_s * 1000)} ms) "
        "and will now be marked with an error"
    )
