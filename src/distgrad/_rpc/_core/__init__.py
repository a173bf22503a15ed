"""The agent core, and its front door: the names below are what the other layers (RRefs, the
group, the public functions, autograd, the profiler, the public modules...) use of it, and
they import them from here -- ``from distgrad._rpc._core import RpcAgent`` -- never from the
modules inside (``tests/unit/test_import_graph.py`` holds every layer to that). What is not
named here is the core's own business.

* the agent (``_agent``) and the thread's agent: :class:`RpcAgent`, :func:`current_agent`,
  :func:`require_agent`, :func:`bind_thread`, :func:`set_current_agent`, ``thread_binding``;
* workers and the agent's state: :class:`WorkerInfo`, :func:`validate_worker_name`,
  :class:`MembershipEvent`, :class:`AgentState`, :class:`AgentStatistics`,
  :class:`PeerStatistics`, :class:`FunctionStatistics` and the metrics' fixed
  ``LATENCY_BOUNDS`` and ``OUTCOMES``;
* futures and functions (``_calls``, ``_functions``, ``_torchscript``, ``_messages``): what a
  call's future is and how it fails, ``@async_execution`` and the internal handlers' marks,
  TorchScript targets, message types;
* options and backends (``_options``): torch's options classes and the backend registry
  (``BackendType`` as the core started; :func:`backend_type`: as it is now, a backend
  registered later included);
* errors (``_remote_error``): :class:`RemoteTraceback`, :func:`report_udf_error`;
* the layer protocol (``_layer``): :class:`RpcLayer`, :class:`LayerAgent`, :class:`CallRecord`,
  :class:`KeyScope`, :func:`register_layer`, :func:`call_recorder`, :func:`shutting_down`,
  ``recording`` (per thread: whether the recording layer is asked about calls on it);
  and two hook modules a layer works through: ``profiling`` (``_profiling``: the profiled
  call paths, ``key_scope``, and the serving wrapper the server-side profiler sets) and
  ``delivery`` (``_delivery``: what a request's pickled objects hear of its failure); and
  ``tracing`` (``_tracing``: spans across workers, a W3C ``traceparent`` in each request).
"""

from . import _delivery as delivery
from . import _profiling as profiling
from . import _tracing as tracing
from ._agent import (
    RpcAgent,
    bind_thread,
    current_agent,
    require_agent,
    set_current_agent,
    thread_binding,
)
from ._calls import (
    RpcFuture,
    check_async_result,
    failed_future,
    fresh_copy,
    is_builtin,
    set_future_error,
)
from ._events import MembershipEvent
from ._functions import after_current_task, async_execution, on_io_thread
from ._layer import (
    CallRecord,
    KeyScope,
    LayerAgent,
    RpcLayer,
    call_recorder,
    recording,
    register_layer,
    shutting_down,
)
from ._messages import describe_request, function_name, is_script, message_type
from ._options import (
    BackendType,
    BackendValue,
    FaultyTensorPipeRpcBackendOptions,
    RpcBackendOptions,
    TensorPipeRpcBackendOptions,
    backend_registered,
    backend_type,
    construct_rpc_backend_options,
    infer_backend,
    is_backend_type,
    register_backend,
    register_faulty_backend,
)
from ._remote_error import RemoteTraceback, report_udf_error
from ._statistics import (
    LATENCY_BOUNDS,
    OUTCOMES,
    AgentState,
    AgentStatistics,
    FunctionStatistics,
    PeerStatistics,
)
from ._torchscript import SCRIPT_TARGETS, as_rpc_target, rref_limit
from ._worker_info import WorkerInfo, validate_worker_name

__all__ = [
    "LATENCY_BOUNDS",
    "OUTCOMES",
    "SCRIPT_TARGETS",
    "AgentState",
    "AgentStatistics",
    "BackendType",
    "BackendValue",
    "CallRecord",
    "FaultyTensorPipeRpcBackendOptions",
    "FunctionStatistics",
    "KeyScope",
    "LayerAgent",
    "MembershipEvent",
    "PeerStatistics",
    "RemoteTraceback",
    "RpcAgent",
    "RpcBackendOptions",
    "RpcFuture",
    "RpcLayer",
    "TensorPipeRpcBackendOptions",
    "WorkerInfo",
    "after_current_task",
    "as_rpc_target",
    "async_execution",
    "backend_registered",
    "backend_type",
    "bind_thread",
    "call_recorder",
    "check_async_result",
    "construct_rpc_backend_options",
    "current_agent",
    "delivery",
    "describe_request",
    "failed_future",
    "fresh_copy",
    "function_name",
    "infer_backend",
    "is_backend_type",
    "is_builtin",
    "is_script",
    "message_type",
    "on_io_thread",
    "profiling",
    "recording",
    "register_backend",
    "register_faulty_backend",
    "register_layer",
    "report_udf_error",
    "require_agent",
    "rref_limit",
    "set_current_agent",
    "set_future_error",
    "shutting_down",
    "thread_binding",
    "tracing",
    "validate_worker_name",
]
