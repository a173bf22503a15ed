"""Unit tests of the RPC API surface that need no running worker: backend options, worker
names, ``WorkerInfo``, constants, argument checks of ``init_rpc`` and the not-initialized
errors (SPEC 1.1)."""

from __future__ import annotations

import pickle
import re
import traceback
from datetime import timedelta
from typing import Any

import pytest
import torch

import distgrad.rpc as rpc
from distgrad._rpc._core._worker_info import validate_worker_name

NOT_INITIALIZED = re.escape(
    "RPC has not been initialized. Call torch.distributed.rpc.init_rpc first."
)


def exact(message: str) -> str:
    """A ``match=`` pattern for exactly ``message``."""
    return "^" + re.escape(message) + "$"


NAME_ERROR = (
    "Worker name must match ^[A-Za-z0-9-_:]*$, and must be non-empty and shorter than 128 "
    "chars, but got {}"
)


# -- options -----------------------------------------------------------------------------------


def test_option_defaults_match_the_reference() -> None:
    """TensorPipeRpcBackendOptions() has torch's defaults."""
    opts = rpc.TensorPipeRpcBackendOptions()
    assert opts.num_worker_threads == 16
    assert opts.rpc_timeout == 60.0
    assert opts.init_method == "env://"
    assert opts.device_maps == {}
    assert opts.devices == []
    assert isinstance(opts, rpc.RpcBackendOptions)


def test_options_are_keyword_only() -> None:
    """As torch's, TensorPipeRpcBackendOptions takes keyword arguments only."""
    with pytest.raises(TypeError):
        rpc.TensorPipeRpcBackendOptions(8)  # type: ignore[misc]


@pytest.mark.parametrize("timeout", [-1, -0.001, -60.0])
def test_negative_rpc_timeout_is_refused(timeout: float) -> None:
    """A negative rpc_timeout raises the reference's RuntimeError."""
    with pytest.raises(RuntimeError, match=exact("RPC Timeout must be non-negative")):
        rpc.TensorPipeRpcBackendOptions(rpc_timeout=timeout)
    with pytest.raises(RuntimeError, match=exact("RPC Timeout must be non-negative")):
        rpc.RpcBackendOptions(rpc_timeout=timeout)


def test_zero_and_integer_timeouts_are_accepted_as_floats() -> None:
    """rpc_timeout=0 (no timeout) and integers are accepted and stored as float seconds."""
    assert rpc.TensorPipeRpcBackendOptions(rpc_timeout=0).rpc_timeout == 0.0
    opts = rpc.TensorPipeRpcBackendOptions(rpc_timeout=5)
    assert opts.rpc_timeout == 5.0 and isinstance(opts.rpc_timeout, float)


@pytest.mark.parametrize("bad", [timedelta(seconds=5), "5", None])
def test_non_number_timeout_is_a_type_error(bad: Any) -> None:
    """rpc_timeout of another type (a timedelta, a string) raises TypeError as pybind does."""
    with pytest.raises(TypeError, match="incompatible constructor arguments"):
        rpc.TensorPipeRpcBackendOptions(rpc_timeout=bad)


def test_device_map_keys_and_values_are_normalised() -> None:
    """Device maps accept str and torch.device and store torch.device on both sides."""
    opts = rpc.TensorPipeRpcBackendOptions(device_maps={"w1": {"cuda:0": "cuda:1"}})
    opts.set_device_map("w1", {torch.device("cuda", 2): "cuda:3"})
    opts.set_device_map("w2", {"cpu": "cpu"})
    assert opts.device_maps == {
        "w1": {
            torch.device("cuda:0"): torch.device("cuda:1"),
            torch.device("cuda:2"): torch.device("cuda:3"),
        },
        "w2": {torch.device("cpu"): torch.device("cpu")},
    }


def test_set_device_map_conflict_message() -> None:
    """Mapping one device to two targets raises the reference's set_device_map error."""
    opts = rpc.TensorPipeRpcBackendOptions()
    opts.set_device_map("w1", {"cuda:0": "cuda:1"})
    opts.set_device_map("w1", {"cuda:0": "cuda:1"})  # the same pair again is fine
    with pytest.raises(
        ValueError,
        match=re.escape(
            "`set_device_map` only supports 1-to-1 mapping, "
            "trying to map cuda:0 to cuda:2 and cuda:1"
        ),
    ):
        opts.set_device_map("w1", {"cuda:0": "cuda:2"})
    assert opts.device_maps["w1"] == {torch.device("cuda:0"): torch.device("cuda:1")}


def test_device_map_not_one_to_one_message() -> None:
    """Two sources mapped to one target raise the reference's device_map error."""
    with pytest.raises(
        ValueError,
        match=re.escape(
            "`device_map` only supports 1-to-1 mapping, trying to map cuda:2 and cuda:0 to cuda:1"
        ),
    ):
        rpc.TensorPipeRpcBackendOptions(
            device_maps={"w1": {"cuda:0": "cuda:1", "cuda:2": "cuda:1"}}
        )


def test_negative_device_index() -> None:
    """A negative device index raises the reference's error."""
    opts = rpc.TensorPipeRpcBackendOptions()
    with pytest.raises(RuntimeError, match="Device index must not be negative"):
        opts.set_device_map("w1", {torch.device("cuda", -1): "cuda:0"})


def test_set_devices_requires_cuda_devices() -> None:
    """set_devices with a CPU device raises the reference's ValueError; CUDA ones are kept."""
    opts = rpc.TensorPipeRpcBackendOptions()
    with pytest.raises(
        ValueError,
        match=re.escape("`set_devices` expect a list of CUDA devices, but got device type cpu."),
    ):
        opts.set_devices(["cpu"])
    with pytest.raises(ValueError, match="but got device type cpu"):
        rpc.TensorPipeRpcBackendOptions(devices=[torch.device("cpu")])
    opts.set_devices([torch.device("cuda", 0), "cuda:1"])
    assert opts.devices == [torch.device("cuda:0"), torch.device("cuda:1")]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_worker_threads": 0}, "num_worker_threads"),
        ({"max_message_size": 0}, "max_message_size"),
        ({"heartbeat_interval": 1.0, "peer_timeout": 1.0}, "heartbeat_interval"),
        ({"heartbeat_interval": 0, "peer_timeout": 1.0}, "heartbeat_interval"),
    ],
)
def test_distgrad_option_bounds(kwargs: dict[str, Any], message: str) -> None:
    """distgrad's own options refuse values that could not work."""
    with pytest.raises(ValueError, match=message):
        rpc.TensorPipeRpcBackendOptions(**kwargs)


def test_tls_needs_both_contexts() -> None:
    """A server TLS context without a client one (or the reverse) is refused."""
    import ssl

    with pytest.raises(ValueError, match="TLS needs both"):
        rpc.TensorPipeRpcBackendOptions(server_ssl_context=ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER))


def test_secret_given_as_text_is_bytes() -> None:
    """A secret given as str is kept as its UTF-8 bytes."""
    assert rpc.TensorPipeRpcBackendOptions(secret="s3cret").secret == b"s3cret"


@pytest.mark.parametrize("empty", ["", b""])
def test_empty_secret_is_refused(empty: str | bytes) -> None:
    """An empty secret is an error, not silently replaced by another source."""
    with pytest.raises(ValueError, match="secret must not be empty"):
        rpc.TensorPipeRpcBackendOptions(secret=empty)


def test_constants_match_the_reference() -> None:
    """rpc.constants has torch's names and values."""
    c = rpc.constants
    assert c.DEFAULT_RPC_TIMEOUT_SEC == 60.0
    assert c.DEFAULT_INIT_METHOD == "env://"
    assert c.DEFAULT_NUM_WORKER_THREADS == 16
    assert c.UNSET_RPC_TIMEOUT == -1.0
    assert c.DEFAULT_SHUTDOWN_TIMEOUT == 0


def test_backend_registry() -> None:
    """TENSORPIPE is registered; registering it again raises the reference's error;
    construct_rpc_backend_options builds TensorPipe options."""
    assert rpc.backend_registered("TENSORPIPE")
    assert rpc.BackendType.TENSORPIPE.name == "TENSORPIPE"
    with pytest.raises(RuntimeError, match=exact("RPC backend TENSORPIPE: already registered")):
        rpc.register_backend("TENSORPIPE", lambda **kw: None, lambda *a: None)  # type: ignore[arg-type,return-value]
    opts = rpc.construct_rpc_backend_options(
        rpc.BackendType.TENSORPIPE, rpc_timeout=7.0, num_worker_threads=3
    )
    assert isinstance(opts, rpc.TensorPipeRpcBackendOptions)
    assert (opts.rpc_timeout, opts.num_worker_threads) == (7.0, 3)


# -- worker names and WorkerInfo ---------------------------------------------------------------


@pytest.mark.parametrize("name", ["", "a b", "w/1", "wörker", "x" * 128, "tab\t"])
def test_bad_worker_names(name: str) -> None:
    """Invalid names raise the reference's message, naming the bad name."""
    with pytest.raises(RuntimeError, match=re.escape(NAME_ERROR.format(name)) + "$"):
        validate_worker_name(name)


@pytest.mark.parametrize("name", ["w", "worker0", "A-b_c:9", "x" * 127, "0", "::"])
def test_good_worker_names(name: str) -> None:
    """Names of the allowed characters and under 128 chars are valid."""
    assert validate_worker_name(name) == name


@pytest.mark.parametrize("name", ["", "a b", "w/1", "wörker", "x" * 128])
def test_worker_info_refuses_bad_names(name: str) -> None:
    """WorkerInfo(name, id) validates the name as torch's constructor does."""
    with pytest.raises(RuntimeError, match=re.escape(NAME_ERROR.format(name)) + "$"):
        rpc.WorkerInfo(name, 0)


@pytest.mark.parametrize(("name", "id"), [(5, 0), ("w", "0"), ("w", 32768), ("w", -32769)])
def test_worker_info_refuses_bad_types_and_ids(name: Any, id: Any) -> None:
    """A name that is no str, or an id that is no int16, is torch's constructor TypeError."""
    with pytest.raises(TypeError, match="incompatible constructor arguments"):
        rpc.WorkerInfo(name, id)


def test_worker_info() -> None:
    """WorkerInfo: attributes, repr/str, equality on (id, name), hash = hash(id)."""
    info = rpc.WorkerInfo("worker3", 3)
    assert (info.name, info.id) == ("worker3", 3)
    assert repr(info) == str(info) == "WorkerInfo(id=3, name=worker3)"
    assert info == rpc.WorkerInfo("worker3", 3)
    assert info != rpc.WorkerInfo("worker3", 4)
    assert info != rpc.WorkerInfo("other", 3)
    assert info != ("worker3", 3)
    assert hash(info) == hash(3)
    assert len({info, rpc.WorkerInfo("worker3", 3), rpc.WorkerInfo("w", 1)}) == 2


def test_worker_info_pickles() -> None:
    """WorkerInfo survives pickle (plain and distgrad's wire pickler) as an equal object."""
    from distgrad._wire._pickler import dumps, loads

    info = rpc.WorkerInfo("worker1", 1)
    assert pickle.loads(pickle.dumps(info)) == info
    meta, buffers, flags = dumps([info])
    assert loads(meta, buffers, flags) == [info]
    assert type(pickle.loads(pickle.dumps(info))) is rpc.WorkerInfo


# -- init_rpc argument checks (raised before any rendezvous) -----------------------------------


def test_init_rpc_rejects_a_bad_name_before_rendezvous() -> None:
    """A bad worker name fails init_rpc at once (no store is contacted)."""
    with pytest.raises(RuntimeError, match=re.escape(NAME_ERROR.format("bad name!"))):
        rpc.init_rpc("bad name!", rank=0, world_size=1)
    assert not rpc._is_current_rpc_agent_set()


def test_init_rpc_rejects_a_bad_backend() -> None:
    """A backend that is not a BackendType member raises the reference's TypeError."""
    with pytest.raises(TypeError, match=exact("Argument backend must be a member of BackendType")):
        rpc.init_rpc("w", backend="TENSORPIPE", rank=0, world_size=1)


def test_init_rpc_rejects_bad_options() -> None:
    """Options that are not RpcBackendOptions raise the reference's TypeError."""
    with pytest.raises(
        TypeError,
        match=exact("Argument rpc_backend_options must be an instance of RpcBackendOptions"),
    ):
        rpc.init_rpc("w", rank=0, world_size=1, rpc_backend_options=object())  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "options", [rpc.RpcBackendOptions(), torch.distributed.rpc.RpcBackendOptions()]
)
def test_init_rpc_cannot_infer_a_backend(options: Any) -> None:
    """Base-class options (distgrad's or torch's) name no backend: torch's TypeError, before
    any rendezvous."""
    with pytest.raises(TypeError, match=f"^{re.escape('Could not infer backend for options <')}"):
        rpc.init_rpc("w", rank=0, world_size=1, rpc_backend_options=options)
    assert not rpc._is_current_rpc_agent_set()


def test_backend_is_inferred_from_options() -> None:
    """Options of the TensorPipe type (distgrad's or torch's) infer TENSORPIPE."""
    from distgrad._rpc._core._options import infer_backend

    assert infer_backend(rpc.TensorPipeRpcBackendOptions()) is rpc.BackendType.TENSORPIPE
    torch_options = torch.distributed.rpc.TensorPipeRpcBackendOptions()
    assert infer_backend(torch_options) is rpc.BackendType.TENSORPIPE
    assert repr(rpc.BackendType.TENSORPIPE) == "BackendType.TENSORPIPE"


def test_init_rpc_backend_checks_its_arguments() -> None:
    """rpc._init_rpc_backend checks argument types with torch's message."""
    with pytest.raises(
        RuntimeError,
        match=exact(
            "Argument None must be of type <class 'torch.distributed.distributed_c10d.Store'> "
            "but got type <class 'NoneType'>"
        ),
    ):
        rpc._init_rpc_backend(
            rpc.BackendType.TENSORPIPE, None, "w", 0, 1, rpc.TensorPipeRpcBackendOptions()
        )


# -- use before init ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "call",
    [
        lambda: rpc.rpc_sync("w", torch.add, (1, 1)),
        lambda: rpc.rpc_async("w", torch.add, (1, 1)),
        rpc.get_worker_info,
        lambda: rpc.get_worker_info("w"),
        rpc.shutdown,
        lambda: rpc.shutdown(graceful=False),
        rpc.get_rpc_timeout,
        lambda: rpc._set_rpc_timeout(1.0),
        rpc._get_debug_info,
        lambda: rpc.api._all_gather(1),
        lambda: rpc.api._barrier(["w"]),
    ],
    ids=[
        "rpc_sync",
        "rpc_async",
        "get_worker_info",
        "get_worker_info_name",
        "shutdown",
        "shutdown_not_graceful",
        "get_rpc_timeout",
        "set_rpc_timeout",
        "get_debug_info",
        "all_gather",
        "barrier",
    ],
)
def test_api_before_init(call: Any) -> None:
    """Every API used before init_rpc raises the reference's not-initialized error."""
    with pytest.raises(RuntimeError, match=NOT_INITIALIZED):
        call()
    assert not rpc._is_current_rpc_agent_set()


@pytest.mark.parametrize(
    "call",
    [rpc._get_current_rpc_agent, rpc.api._get_current_rpc_agent, rpc._rref_context_get_debug_info],
    ids=["rpc", "rpc.api", "rref_context_debug_info"],
)
def test_current_agent_before_init(call: Any) -> None:
    """The agent's accessors used before init_rpc raise torch's "Current RPC agent is not
    set!" error (torch's C++ check, not the Python decorator's)."""
    with pytest.raises(
        RuntimeError,
        match=exact(
            "Current RPC agent is not set! Did you initialize the RPC framework (e.g. by "
            "calling `rpc.init_rpc`)?"
        ),
    ):
        call()
    assert rpc.api._is_current_rpc_agent_set() is rpc._is_current_rpc_agent_set() is False


def test_is_available() -> None:
    """rpc.is_available() is True."""
    assert rpc.is_available() is True


# -- the exception tree ------------------------------------------------------------------------
PUBLIC_ERRORS = [
    "DistgradError",
    "HandshakeError",
    "MessageTooLargeError",
    "PeerFailureError",
    "ProtocolError",
    "RpcShutdownError",
    "RpcTimeoutError",
    "RemoteTraceback",
]


@pytest.mark.parametrize("name", PUBLIC_ERRORS)
def test_public_errors_show_their_public_module(name: str) -> None:
    """Each exception class of distgrad.rpc reports ``distgrad.rpc`` as its module (what
    tracebacks print), is reachable there under that name, and pickles by that reference."""
    cls = getattr(rpc, name)
    assert cls.__module__ == "distgrad.rpc"
    assert f"distgrad.rpc.{name}" in "".join(traceback.format_exception_only(cls, cls("boom")))
    assert pickle.loads(pickle.dumps(cls)) is cls


def test_backward_error_shows_its_public_module() -> None:
    """distgrad.autograd.BackwardError reports ``distgrad.autograd`` as its module."""
    import distgrad.autograd

    cls = distgrad.autograd.BackwardError
    assert cls.__module__ == "distgrad.autograd"
    assert pickle.loads(pickle.dumps(cls)) is cls


def test_rpc_timeout_error_is_a_runtime_error_and_a_timeout_error() -> None:
    """RpcTimeoutError is caught by ``except RuntimeError`` (torch's callers) and by ``except
    TimeoutError``; its message and pickled copies are unchanged."""
    from distgrad._errors import rpc_timeout_message

    error = rpc.RpcTimeoutError(rpc_timeout_message(1.5))
    assert isinstance(error, RuntimeError) and isinstance(error, TimeoutError)
    assert isinstance(error, rpc.DistgradError)
    assert str(error) == (
        "RPCErr:1:RPC ran for more than set timeout (1500 ms) and will now be marked with an error"
    )
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is rpc.RpcTimeoutError and str(copy) == str(error)
    with pytest.raises(TimeoutError, match="RPC ran for more than"):
        raise error
