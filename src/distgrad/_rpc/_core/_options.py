"""Backend options and the backend registry, shaped like torch's so programs run unchanged.

``TensorPipeRpcBackendOptions`` takes torch's arguments (``num_worker_threads``,
``rpc_timeout``, ``init_method``, ``device_maps``, ``devices``) plus distgrad's own, which are
keyword-only and all optional: the cluster ``secret``, a TLS context pair, the maximum message
size, and the heartbeat / peer-failure bounds.
"""

from __future__ import annotations

import enum
import ssl
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from ... import _config
from ..._devices._maps import DeviceLike, check_one_to_one, to_cuda_device
from ..._transport._faulty import Fault, FaultPlan
from ._messages import MESSAGE_TYPES

__all__ = [
    "BackendType",
    "BackendValue",
    "FaultyTensorPipeRpcBackendOptions",
    "RpcBackendOptions",
    "TensorPipeRpcBackendOptions",
    "backend_registered",
    "backend_type",
    "construct_rpc_backend_options",
    "infer_backend",
    "is_backend_type",
    "register_backend",
    "register_faulty_backend",
]


class RpcBackendOptions:
    """Options common to every backend: the default RPC timeout and the init method (torch's
    ``RpcBackendOptions``).

    Args:
        rpc_timeout (float): default timeout of calls, in seconds (``0``: none).
        init_method (str): how workers meet: ``"env://"`` (``MASTER_ADDR``/``MASTER_PORT``),
            ``"tcp://host:port"`` or ``"file:///path"``.

    Raises:
        TypeError: ``rpc_timeout`` is not a number ("incompatible constructor arguments").
        RuntimeError: ``rpc_timeout`` is negative ("RPC Timeout must be non-negative").
    """

    def __init__(
        self,
        rpc_timeout: float = _config.DEFAULT_RPC_TIMEOUT_SEC,
        init_method: str = _config.DEFAULT_INIT_METHOD,
    ) -> None:
        if not isinstance(rpc_timeout, (int, float)) or isinstance(rpc_timeout, bool):
            raise TypeError("incompatible constructor arguments")
        if rpc_timeout < 0:
            raise RuntimeError("RPC Timeout must be non-negative")
        self.rpc_timeout = float(rpc_timeout)
        self.init_method = init_method


class TensorPipeRpcBackendOptions(RpcBackendOptions):
    """Options of distgrad's agent, named as torch's ``TensorPipeRpcBackendOptions`` so that
    torch programs run unchanged; all arguments are keyword-only.

    Args:
        num_worker_threads (int): how many user functions may run at once on this worker
            (16); threads blocked in nested RPCs do not count.
        rpc_timeout (float): default timeout of calls in seconds (60; ``0``: none).
        init_method (str): how workers meet: ``"env://"`` (the default), ``"tcp://host:port"``
            or ``"file:///path"``.
        device_maps (dict, optional): ``{worker_name: {local_device: remote_device}}``:
            where this worker's tensors land on each callee (responses come back by the
            inverse); ``"cpu"`` may appear on either side (docs/cuda.md).
        devices (list, optional): the CUDA devices this worker uses (default: those its
            maps and its peers' maps name).
        _transports, _channels: TensorPipe's tuning; accepted and ignored.
        secret (bytes or str, optional): cluster secret for the connection handshake. Default:
            ``$DISTGRAD_SECRET``, else rank 0 generates one and shares it through the
            rendezvous store -- which then must be trusted (see docs/security.md).
        server_ssl_context, client_ssl_context (ssl.SSLContext, optional): TLS on TCP
            connections between hosts (both or neither).
        max_message_size (int): bound on one message in bytes (16 GiB), published to the
            peers: a message above this worker's or the receiver's bound fails its call
            before it is sent; a larger frame that arrives anyway drops the connection.
        heartbeat_interval (float): seconds between heartbeats on an idle connection (1).
        peer_timeout (float): a peer silent this many seconds is *suspected* (4): what waits
            on it fails, a later call connects again (docs/failure-semantics.md).
        listen_addr (str, optional): address to listen on for TCP (default: the local address
            that routes to the rendezvous master; ``$DISTGRAD_LISTEN_ADDR``).
        fail_stop (bool): a peer whose connection is lost, or that is silent for
            ``peer_timeout``, is dead for the rest of the group's life (no reconnection):
            distgrad's behaviour before suspicion. Also ``DISTGRAD_FAIL_STOP=1``.
        pickler (optional): what pickles this worker's messages, for the whole process: any
            object with pickle's shape (a ``Pickler`` class and optionally an ``Unpickler``
            class: the ``dill`` or ``cloudpickle`` module), or torch's ``_InternalRPCPickler``
            shape (``_pickler(f)`` / ``_unpickler(f)``). Tensors still travel out of band;
            checked by a round trip at ``init_rpc``. Default: pickle. torch's
            ``rpc.api._use_rpc_pickler`` does the same for code written against it.
        allowed_calls, allowed_classes (list, optional): an allow-list (off by default,
            torch's behaviour): the functions peers may run here, and the classes and functions
            their messages may make this worker unpickle -- callables, dotted names
            (``"mypkg.train"``) or module prefixes (``"mypkg.*"``); distgrad's own messages are
            always allowed. Also ``DISTGRAD_ALLOWED_CALLS`` / ``DISTGRAD_ALLOWED_CLASSES``
            (comma-separated). A refused request fails with an error naming what was refused;
            the connection stays up (docs/security.md).
        metrics_addr (str, optional): ``host:port`` (port 0: any) of this worker's metrics
            endpoint -- Prometheus text at ``/metrics``, JSON at ``/json`` (what ``distgrad
            top`` reads); off by default; also ``$DISTGRAD_METRICS_ADDR``. Where the host is
            not loopback, requests need the bearer token derived from the cluster secret, and
            with TLS contexts it is served over TLS (docs/observability.md).

    Raises:
        ValueError: ``num_worker_threads`` below 1, TLS with only one context, a
            non-positive ``max_message_size``, ``peer_timeout`` not above
            ``heartbeat_interval``, an empty secret, or an invalid device map.
        TypeError, RuntimeError: a bad ``rpc_timeout`` (as ``RpcBackendOptions``).

    Example:
        # On every worker (the same secret everywhere):
        options = rpc.TensorPipeRpcBackendOptions(
            init_method="tcp://10.0.0.1:29500", rpc_timeout=20, secret=os.environ["MY_SECRET"]
        )
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2, rpc_backend_options=options)
    """

    def __init__(
        self,
        *,
        num_worker_threads: int = _config.DEFAULT_NUM_WORKER_THREADS,
        rpc_timeout: float = _config.DEFAULT_RPC_TIMEOUT_SEC,
        init_method: str = _config.DEFAULT_INIT_METHOD,
        device_maps: dict[str, dict[DeviceLike, DeviceLike]] | None = None,
        devices: list[DeviceLike] | None = None,
        _transports: list[Any] | None = None,
        _channels: list[Any] | None = None,
        secret: bytes | str | None = None,
        server_ssl_context: ssl.SSLContext | None = None,
        client_ssl_context: ssl.SSLContext | None = None,
        max_message_size: int = _config.DEFAULT_MAX_MESSAGE_SIZE,
        heartbeat_interval: float = _config.DEFAULT_HEARTBEAT_INTERVAL,
        peer_timeout: float = _config.DEFAULT_PEER_TIMEOUT,
        listen_addr: str | None = None,
        fail_stop: bool = False,
        pickler: Any = None,
        allowed_calls: Iterable[Any] | None = None,
        allowed_classes: Iterable[Any] | None = None,
        metrics_addr: str | None = None,
    ) -> None:
        super().__init__(rpc_timeout, init_method)
        if num_worker_threads < 1:
            raise ValueError("num_worker_threads must be at least 1")
        if (server_ssl_context is None) != (client_ssl_context is None):
            raise ValueError("TLS needs both server_ssl_context and client_ssl_context")
        if max_message_size <= 0:
            raise ValueError("max_message_size must be positive")
        if heartbeat_interval <= 0 or peer_timeout <= heartbeat_interval:
            raise ValueError("need 0 < heartbeat_interval < peer_timeout")
        self.num_worker_threads = num_worker_threads
        self.device_maps: dict[str, dict[torch.device, torch.device]] = {}
        self.devices: list[torch.device] = []
        self._transports = _transports
        self._channels = _channels
        self.secret = secret.encode() if isinstance(secret, str) else secret
        if self.secret is not None and not self.secret:
            raise ValueError("secret must not be empty (leave it None to use DISTGRAD_SECRET)")
        self.server_ssl_context = server_ssl_context
        self.client_ssl_context = client_ssl_context
        self.max_message_size = max_message_size
        self.heartbeat_interval = heartbeat_interval
        self.peer_timeout = peer_timeout
        self.listen_addr = listen_addr
        self.fail_stop = fail_stop
        self.pickler = pickler
        self.allowed_calls = None if allowed_calls is None else list(allowed_calls)
        self.allowed_classes = None if allowed_classes is None else list(allowed_classes)
        self.metrics_addr = metrics_addr
        for to, device_map in (device_maps or {}).items():
            self.set_device_map(to, device_map)
        if devices:
            self.set_devices(devices)

    def set_device_map(self, to: str, device_map: dict[DeviceLike, DeviceLike]) -> None:
        """Map this worker's devices to ``to``'s devices, 1-to-1, as torch's method: tensors
        this worker sends to ``to`` land there on the mapped devices, and ``to``'s responses
        come back by the inverse map.

        Args:
            to (str): the callee's name.
            device_map (dict): ``{this worker's device: the callee's device}``; devices as
                ``torch.device``, strings (``"cuda:0"``, ``"cpu"``) or indices of the
                current accelerator (as torch: an error on a build without one).

        Raises:
            ValueError: the map is not 1-to-1 (with the maps already set for ``to``).
            RuntimeError: a negative device index.

        Example:
            options = rpc.TensorPipeRpcBackendOptions()
            options.set_device_map("worker1", {0: 1})  # this worker's cuda:0 -> worker1's cuda:1
        """
        full = check_one_to_one(device_map)
        current = self.device_maps.get(to, {})
        for k, v in full.items():
            if k in current and current[k] != v:
                raise ValueError(
                    "`set_device_map` only supports 1-to-1 mapping, "
                    f"trying to map {k} to {v} and {current[k]}"
                )
        # as torch: two sources mapped to one target over two calls pass here, fail at init
        self.device_maps[to] = {**current, **full}

    def set_devices(self, devices: list[DeviceLike]) -> None:
        """Set the CUDA devices this worker uses, as torch's method (its streams are
        synchronised on them when serving CUDA calls).

        Args:
            devices (list): CUDA devices (``torch.device``, ``"cuda:0"`` or an index).

        Raises:
            ValueError: a device that is not a CUDA device.
        """
        self.devices = [to_cuda_device(d) for d in devices]

    def __repr__(self) -> str:
        return (
            f"TensorPipeRpcBackendOptions(num_worker_threads={self.num_worker_threads}, "
            f"rpc_timeout={self.rpc_timeout}, init_method={self.init_method!r})"
        )


class FaultyTensorPipeRpcBackendOptions(TensorPipeRpcBackendOptions):
    """Options of the fault-injecting backend ``FAULTY_TENSORPIPE`` (torch's, from
    ``distgrad.rpc._testing``): the first ``num_fail_sends`` sends of each distinct message of a
    type in ``messages_to_fail`` fail (``RPCErr:2:Send attempt failed intentionally for ...``),
    and messages of a type in ``messages_to_delay`` are sent that many seconds late.

    Type names are torch's (``PYTHON_CALL``, ``SCRIPT_CALL``, ``PYTHON_REMOTE_CALL``,
    ``SCRIPT_REMOTE_CALL``, ``PYTHON_RREF_FETCH_CALL``, ``SCRIPT_RREF_FETCH_CALL``,
    ``RREF_FORK_REQUEST``, ``RREF_CHILD_ACCEPT``, ``RREF_USER_DELETE``,
    ``CLEANUP_AUTOGRAD_CONTEXT_REQ``, and distgrad's others such as ``BACKWARD_AUTOGRAD_REQ``).
    Beyond torch's arguments, ``faults`` takes distgrad's rules (``distgrad.testing.Fault``:
    drop, duplicate, reorder ... chosen by type, function, peer, count), and every
    :class:`TensorPipeRpcBackendOptions` keyword is accepted (docs/testing-fault-tolerance.md).
    """

    def __init__(
        self,
        num_worker_threads: int = _config.DEFAULT_NUM_WORKER_THREADS,
        rpc_timeout: float = _config.DEFAULT_RPC_TIMEOUT_SEC,
        init_method: str = _config.DEFAULT_INIT_METHOD,
        messages_to_fail: list[str] | tuple[str, ...] = (),
        messages_to_delay: dict[str, float] | None = None,
        num_fail_sends: int = 0,
        *,
        faults: Sequence[Fault] = (),
        **options: Any,
    ) -> None:
        super().__init__(
            num_worker_threads=num_worker_threads,
            rpc_timeout=rpc_timeout,
            init_method=init_method,
            **options,
        )
        if num_fail_sends < 0:
            raise RuntimeError("numFailSends should be non-negative")
        delays = dict(messages_to_delay or {})
        for name in [*messages_to_fail, *delays]:
            if name not in MESSAGE_TYPES:
                raise RuntimeError(f"No mapping to rpc::MessageType exists for {name}")
        if any(delay < 0 for delay in delays.values()):
            raise RuntimeError("Delays passed to FaultyTensorPipeAgent must be non-negative.")
        self.messages_to_fail = list(messages_to_fail)
        self.messages_to_delay = {name: float(delay) for name, delay in delays.items()}
        self.num_fail_sends = num_fail_sends
        self.faults = list(faults)

    def fault_plan(self) -> FaultPlan:
        """A fresh plan of these faults (one per agent: counts start over)."""
        return FaultPlan(
            self.faults,
            messages_to_fail=self.messages_to_fail,
            num_fail_sends=self.num_fail_sends,
            messages_to_delay=self.messages_to_delay,
        )

    def __repr__(self) -> str:
        return (
            f"FaultyTensorPipeRpcBackendOptions(num_worker_threads={self.num_worker_threads}, "
            f"rpc_timeout={self.rpc_timeout}, init_method={self.init_method!r}, "
            f"messages_to_fail={self.messages_to_fail!r}, "
            f"messages_to_delay={self.messages_to_delay!r}, "
            f"num_fail_sends={self.num_fail_sends})"
        )


class BackendValue:
    """What a registered backend stands for: its options handler and init handler (the value
    of each ``BackendType`` member, as torch's ``BackendValue``).

    Args:
        construct_rpc_backend_options_handler (Callable): builds the backend's options from
            ``rpc_timeout``, ``init_method`` and keyword arguments.
        init_backend_handler (Callable, optional): torch calls it to build the agent;
            distgrad keeps it but always starts its own agent.
    """

    def __init__(
        self,
        construct_rpc_backend_options_handler: Callable[..., RpcBackendOptions],
        init_backend_handler: Callable[..., Any] | None,
    ) -> None:
        self.construct_rpc_backend_options_handler = construct_rpc_backend_options_handler
        self.init_backend_handler = init_backend_handler


def _construct_tensorpipe_options(
    rpc_timeout: float = _config.DEFAULT_RPC_TIMEOUT_SEC,
    init_method: str = _config.DEFAULT_INIT_METHOD,
    num_worker_threads: int = _config.DEFAULT_NUM_WORKER_THREADS,
    **kwargs: Any,
) -> TensorPipeRpcBackendOptions:
    return TensorPipeRpcBackendOptions(
        rpc_timeout=rpc_timeout,
        init_method=init_method,
        num_worker_threads=num_worker_threads,
        **kwargs,
    )


_registry: dict[str, BackendValue] = {
    "TENSORPIPE": BackendValue(_construct_tensorpipe_options, None),
}


def _backend_type_repr(self: enum.Enum) -> str:
    return "BackendType." + self.name


def _make_enum() -> Any:
    make: Any = enum.Enum
    backend_type = make("BackendType", dict(_registry))
    backend_type.__repr__ = _backend_type_repr  # as torch's: "BackendType.TENSORPIPE"
    return backend_type


BackendType: Any = _make_enum()
BackendType.__doc__ = """The RPC backends (torch's ``BackendType``): ``TENSORPIPE``, plus those
added with ``register_backend``. Every member starts distgrad's own agent; ``TENSORPIPE`` is
there so that torch programs passing ``backend=rpc.BackendType.TENSORPIPE`` run unchanged.
A member's value is its ``BackendValue``."""


def backend_type() -> Any:
    """``BackendType`` as it is now: :func:`register_backend` replaces the enum with one that
    has the new member too."""
    return BackendType


def backend_registered(backend_name: str) -> bool:
    """Whether a backend of that name is registered (torch's ``backend_registered``).

    Args:
        backend_name (str): e.g. ``"TENSORPIPE"``.

    Returns:
        bool: ``True`` for ``"TENSORPIPE"`` and every name given to :func:`register_backend`.
    """
    return backend_name in _registry


def register_backend(
    backend_name: str,
    construct_rpc_backend_options_handler: Callable[..., RpcBackendOptions],
    init_backend_handler: Callable[..., Any],
) -> Any:
    """Register a backend name, as torch's ``register_backend``.

    ``init_rpc(backend=member)`` and :func:`construct_rpc_backend_options` then accept the
    returned member, and its options handler builds the options. The agent is always
    distgrad's: ``init_backend_handler`` is never called (docs/migration.md, "Backend
    registry").

    Args:
        backend_name (str): the new member's name.
        construct_rpc_backend_options_handler (Callable): called as
            ``handler(rpc_timeout, init_method, **kwargs)``; returns ``RpcBackendOptions``.
        init_backend_handler (Callable): kept for torch compatibility, unused.

    Returns:
        BackendType: the new member (of a new ``BackendType`` enum that has every
        registered backend; ``rpc.BackendType`` itself keeps the members it had, as in
        torch).

    Raises:
        RuntimeError: the name is taken ("RPC backend {name}: already registered").

    Example:
        def options(rpc_timeout, init_method, **kwargs):
            return rpc.TensorPipeRpcBackendOptions(rpc_timeout=rpc_timeout, init_method=init_method)


        MINE = rpc.register_backend("MINE", options, lambda *args, **kwargs: None)
        rpc.init_rpc("worker0", backend=MINE, rank=0, world_size=1)
    """
    global BackendType
    if backend_registered(backend_name):
        raise RuntimeError(f"RPC backend {backend_name}: already registered")
    _registry[backend_name] = BackendValue(
        construct_rpc_backend_options_handler, init_backend_handler
    )
    BackendType = _make_enum()
    return BackendType[backend_name]


def _construct_faulty_options(
    rpc_timeout: float = _config.DEFAULT_RPC_TIMEOUT_SEC,
    init_method: str = _config.DEFAULT_INIT_METHOD,
    num_worker_threads: int = _config.DEFAULT_NUM_WORKER_THREADS,
    messages_to_fail: list[str] | tuple[str, ...] = (),
    messages_to_delay: dict[str, float] | None = None,
    num_fail_sends: int = 0,
    **kwargs: Any,
) -> FaultyTensorPipeRpcBackendOptions:
    return FaultyTensorPipeRpcBackendOptions(
        num_worker_threads,
        rpc_timeout,
        init_method,
        messages_to_fail,
        messages_to_delay,
        num_fail_sends,
        **kwargs,
    )


def register_faulty_backend() -> None:
    """Register ``FAULTY_TENSORPIPE`` (what importing ``distgrad.rpc._testing`` does)."""
    if not backend_registered("FAULTY_TENSORPIPE"):
        register_backend("FAULTY_TENSORPIPE", _construct_faulty_options, _no_init_handler)


def _no_init_handler(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("distgrad starts its agents in init_rpc; backends need no init handler")


def construct_rpc_backend_options(
    backend: Any,
    rpc_timeout: float = _config.DEFAULT_RPC_TIMEOUT_SEC,
    init_method: str = _config.DEFAULT_INIT_METHOD,
    **kwargs: Any,
) -> RpcBackendOptions:
    """Default options of a backend (torch's ``construct_rpc_backend_options``).

    Args:
        backend (BackendType): the backend, e.g. ``rpc.BackendType.TENSORPIPE``.
        rpc_timeout (float): default call timeout in seconds (60).
        init_method (str): the rendezvous (``"env://"``).
        **kwargs: more keyword arguments of the backend's options (for TENSORPIPE, those of
            ``TensorPipeRpcBackendOptions``).

    Returns:
        RpcBackendOptions: what the backend's options handler builds.

    Example:
        options = rpc.construct_rpc_backend_options(
            rpc.BackendType.TENSORPIPE, rpc_timeout=10, num_worker_threads=8
        )
    """
    options: RpcBackendOptions = backend.value.construct_rpc_backend_options_handler(
        rpc_timeout, init_method, **kwargs
    )
    return options


def infer_backend(options: object) -> Any:
    """The backend whose default options ``options`` is an instance of (torch's inference in
    ``init_rpc``); torch's own TensorPipe options stand for TENSORPIPE. Raises torch's error
    for options of no registered backend (e.g. the base ``RpcBackendOptions``)."""
    for backend in BackendType:
        try:
            default = construct_rpc_backend_options(backend)
        except Exception:  # a registered handler that cannot build defaults matches nothing
            continue
        if isinstance(options, type(default)):
            return backend
    torch_options = getattr(torch.distributed.rpc, "TensorPipeRpcBackendOptions", None)
    if torch_options is not None and isinstance(options, torch_options):
        return BackendType.TENSORPIPE
    raise TypeError(f"Could not infer backend for options {options}")


def is_backend_type(backend: object) -> bool:
    """True for a member of (any generation of) ``BackendType``, or torch's own."""
    if isinstance(backend, enum.Enum) and type(backend).__name__ == "BackendType":
        return backend.name in _registry
    return False
