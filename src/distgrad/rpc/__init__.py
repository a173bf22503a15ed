"""Drop-in replacement for ``torch.distributed.rpc``: ``import distgrad.rpc as rpc``."""

from __future__ import annotations

from typing import Any

# As torch.distributed.rpc does with torch.distributed.autograd: an RPC worker always records
# distributed autograd (importing it installs the recording into the RPC layer).
from .. import autograd as _autograd

# Profiling across workers rides on the same kind of hook (distgrad.profiler installs it).
from .. import profiler as _profiler  # noqa: F401
from .._errors import (
    DistgradError,
    HandshakeError,
    MessageTooLargeError,
    PeerFailureError,
    ProtocolError,
    RpcShutdownError,
    RpcTimeoutError,
)
from .._observe import _endpoint as _observe_endpoint
from .._profiler import _server as _server_profiler
from .._rpc import _api as _api_impl
from .._rpc._api import (
    get_rpc_timeout,
    get_worker_info,
    init_rpc,
    remote,
    rpc_async,
    rpc_sync,
    shutdown,
)
from .._rpc._core import (
    AgentState,
    AgentStatistics,
    BackendValue,
    MembershipEvent,
    PeerStatistics,
    RemoteTraceback,
    RpcBackendOptions,
    TensorPipeRpcBackendOptions,
    WorkerInfo,
    backend_registered,
    construct_rpc_backend_options,
    register_backend,
)
from .._rpc._core import RpcAgent as _RpcAgent
from .._rpc._core import backend_type as _backend_type
from .._rpc._group._membership import add_membership_listener, members, remove_membership_listener
from .._rpc._rrefs._rref import RRef
from .._rpc._rrefs._rref_context import context_of as _context_of
from . import api, backend_registry, constants, functions, internal, options
from .api import AllGatherStates

__all__ = [
    "AgentState",
    "AgentStatistics",
    "AllGatherStates",
    "BackendType",
    "BackendValue",
    "DistgradError",
    "HandshakeError",
    "MembershipEvent",
    "MessageTooLargeError",
    "PeerFailureError",
    "PeerStatistics",
    "ProtocolError",
    "RRef",
    "RemoteTraceback",
    "RpcBackendOptions",
    "RpcShutdownError",
    "RpcTimeoutError",
    "TensorPipeRpcBackendOptions",
    "WorkerInfo",
    "add_membership_listener",
    "api",
    "backend_registered",
    "backend_registry",
    "constants",
    "construct_rpc_backend_options",
    "functions",
    "get_rpc_timeout",
    "get_worker_info",
    "init_rpc",
    "internal",
    "is_available",
    "members",
    "metrics_address",
    "options",
    "register_backend",
    "remote",
    "remove_membership_listener",
    "rpc_async",
    "rpc_sync",
    "shutdown",
]

_observe_endpoint.register()


@_api_impl._require_initialized
def metrics_address() -> str | None:
    """The ``host:port`` of this worker's metrics endpoint (Prometheus text at ``/metrics``,
    JSON at ``/json``), or ``None`` when it has none: it is opt-in, through
    ``TensorPipeRpcBackendOptions(metrics_addr=...)`` or ``$DISTGRAD_METRICS_ADDR``
    (docs/observability.md).

    Raises:
        RuntimeError: RPC is not initialized.
    """
    endpoint = _observe_endpoint.endpoint_of(_get_current_rpc_agent())
    return endpoint.address if endpoint is not None else None


_set_rpc_timeout = _api_impl.set_rpc_timeout
_wait_all = _api_impl.wait_all
_init_rpc_backend = _api_impl.init_rpc_backend
_is_current_rpc_agent_set = api._is_current_rpc_agent_set
_get_current_rpc_agent = api._get_current_rpc_agent
_delete_all_user_and_unforked_owner_rrefs = api._delete_all_user_and_unforked_owner_rrefs
PyRRef = RRef  # torch's C++ base class of RRef; here they are one class
#: torch's agent class (programs check ``isinstance`` against the current agent): distgrad's
#: one agent class, whatever the backend (``FAULTY_TENSORPIPE`` included, as torch's faulty
#: agent is a ``TensorPipeAgent``)
TensorPipeAgent = _RpcAgent
_server_process_global_profile = _server_profiler._server_process_global_profile


@_api_impl._require_initialized
def enable_gil_profiling(flag: bool) -> None:
    """Turn on (or off) the timing that ``agent.gil_average_wait_time_us`` in the agent's
    ``get_debug_info()`` / ``get_metrics()`` reports: the average wait, in microseconds, of a
    request served here between its arrival and a worker thread running Python for it -- the
    thread's wake-up and its taking of the GIL (torch's ``rpc.enable_gil_profiling``; torch
    times its C++ threads' GIL acquisitions).

    Args:
        flag (bool): ``True`` to start (figures reset), ``False`` to stop.

    Raises:
        RuntimeError: RPC is not initialized.
    """
    _get_current_rpc_agent().enable_gil_profiling(flag)


def _rref_context_get_debug_info() -> dict[str, str]:
    """RRef table sizes of this worker (values are strings, as the reference's)."""
    return _context_of(_get_current_rpc_agent()).debug_info()


@_api_impl._require_initialized
def _get_debug_info() -> dict[str, str | int]:
    """torch's ``rpc._get_debug_info()``: the RRef tables' sizes, the agent's metrics and
    distributed autograd's counters, in one dict."""
    info: dict[str, str | int] = {}
    info.update(_rref_context_get_debug_info())
    info.update(_get_current_rpc_agent().get_debug_info())
    info.update(_autograd._get_debug_info())
    return info


def __getattr__(name: str) -> Any:
    # Read when used, so that a backend registered later (FAULTY_TENSORPIPE, by importing
    # distgrad.rpc._testing) is a member (torch's rpc.BackendType stays the first enum).
    if name == "BackendType":
        return _backend_type()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def is_available() -> bool:
    """Whether RPC is available: always ``True`` (torch's ``is_available`` is ``False`` in
    builds without distributed support; distgrad needs only sockets).

    Returns:
        bool: ``True``.
    """
    return True


# public objects report the public module in reprs and tracebacks
for _name in (
    "DistgradError",
    "HandshakeError",
    "MessageTooLargeError",
    "PeerFailureError",
    "ProtocolError",
    "RpcShutdownError",
    "RpcTimeoutError",
    "WorkerInfo",
    "RpcBackendOptions",
    "TensorPipeRpcBackendOptions",
    "RemoteTraceback",
    "RRef",
    "AgentState",
    "AgentStatistics",
    "PeerStatistics",
):
    globals()[_name].__module__ = __name__
