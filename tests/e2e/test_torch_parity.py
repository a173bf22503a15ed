"""distgrad's RPC next to torch's own, side by side: the same program runs once on
``torch.distributed.rpc`` (TensorPipe) and once on ``distgrad.rpc``, and the tests compare what
each observed -- results, exception types and messages (issue 16, items 6-12).

Each implementation runs once per module (two fixtures); every observation is recorded as
plain data by :func:`observe`, and each test compares one case."""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

import distgrad.autograd
import distgrad.rpc
from tests._harness import run_workers

pytestmark = pytest.mark.timeout(150)

Outcome = dict[str, Any]
IMPLS = ("torch", "distgrad")

# The RPC module of the implementation this process runs (set first thing in each worker).
_impl: dict[str, Any] = {}


def _rpc() -> Any:
    return _impl["rpc"]


def _use(impl: str) -> Any:
    if impl == "torch":
        import torch.distributed.rpc as torch_rpc

        _impl["rpc"] = torch_rpc
    else:
        _impl["rpc"] = distgrad.rpc
    return _impl["rpc"]


def observe(call: Callable[[], Any]) -> Outcome:
    """Run ``call``; record its value, or the exception's type and message."""
    try:
        value = call()
    except BaseException as exc:
        return {
            "raised": f"{type(exc).__module__}.{type(exc).__qualname__}",
            "is_runtime_error": isinstance(exc, RuntimeError),
            "message": str(exc),
        }
    if isinstance(value, torch.futures.Future):
        return {"value": "a Future"}
    return {"value": value}


# -- functions the workers call on each other ---------------------------------------------------
class NeedsTwoArgs(Exception):
    """An exception type that cannot be rebuilt from a message alone."""

    def __init__(self, a: object, b: object) -> None:
        super().__init__(a, b)


def add_one(x: Any) -> Any:
    return x + 1


def raise_value_error() -> None:
    raise ValueError("value went wrong")


def raise_needs_two() -> None:
    raise NeedsTwoArgs("first", "second")


def takes_nothing() -> int:
    return 1


def takes_two(a: object, b: object) -> int:
    return 2


def adds_one_to_its_argument(fut: Any) -> Any:
    return fut + 1


def waits(fut: Any) -> Any:
    return fut.wait()


def plus(x: Any, y: Any) -> Any:
    return x + y


@torch.jit.script
def script_add(x: torch.Tensor, y: int) -> torch.Tensor:
    return x + y


@torch.jit.script
def script_fails(x: torch.Tensor) -> torch.Tensor:
    raise ValueError("script went wrong")


@distgrad.rpc.functions.async_execution
@torch.jit.script
def async_script_add(x: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    return torch.jit.fork(script_add, x, 1)


@distgrad.rpc.functions.async_execution
def fan_out(peers: list[str], x: Any) -> Any:
    """Call ``plus`` on every peer, then add up their answers (item 11)."""
    rpc = _rpc()
    futures = [rpc.rpc_async(peer, plus, (x, i)) for i, peer in enumerate(peers)]
    return torch.futures.collect_all(futures).then(lambda done: sum(f.wait() for f in done.wait()))


@distgrad.rpc.functions.async_execution
def fan_out_async(peers: list[str], x: Any) -> Any:
    """A fan-out of fan-outs: each peer runs ``fan_out`` over all peers itself."""
    rpc = _rpc()
    futures = [rpc.rpc_async(peer, fan_out, (peers, x)) for peer in peers]
    return torch.futures.collect_all(futures).then(lambda done: [f.wait() for f in done.wait()])


class Batcher:
    """pytorch/examples' batch RL pattern: callers share one future, completed once a batch
    is full, each getting its own item through ``then``."""

    lock = threading.Lock()
    size = 0
    future: Any = None
    items: list[Any] = []

    @staticmethod
    @distgrad.rpc.functions.async_execution
    def submit(batch_size: int, item: Any) -> Any:
        with Batcher.lock:
            if Batcher.future is None:
                Batcher.future = torch.futures.Future()
                Batcher.items = []
            future, index = Batcher.future, len(Batcher.items)
            Batcher.items.append(item)
            if len(Batcher.items) == batch_size:
                Batcher.future, items = None, Batcher.items
                future.set_result([x * 10 for x in items])
        return future.then(lambda done: done.wait()[index])


def normalise(message: str) -> str:
    """A message with addresses and the implementations' module names taken out."""
    message = re.sub(r" at 0x[0-9a-f]+", " at 0x...", message)
    for module in ("torch._C._distributed_rpc.", "torch.distributed.rpc.", "distgrad.rpc."):
        message = message.replace(module, "")
    return message


def run(rank: int, world_size: int, *, impl: str, port: int) -> dict[str, Outcome]:
    """One worker of the compared program: init, (rank 0) make every call, shut down."""
    rpc = _use(impl)
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}")
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size, rpc_backend_options=opts)
    record: dict[str, Outcome] = {}
    if rank == 0:
        record = calls(world_size)
    rpc.shutdown()
    return record


def calls(world_size: int) -> dict[str, Outcome]:
    rpc = _rpc()
    peer = "worker1"
    everyone = [f"worker{r}" for r in range(world_size)]
    record: dict[str, Outcome] = {}

    def case(name: str, call: Callable[[], Any]) -> None:
        record[name] = observe(call)

    # item 6: Future.then with what is no callback, and callbacks that fail
    def pending() -> Any:
        return rpc.rpc_async(peer, add_one, (1,))

    case("then_none", lambda: pending().then(None))
    case("then_int", lambda: pending().then(42))
    case("add_done_callback_none", lambda: pending().add_done_callback(None))
    case("then_takes_nothing", lambda: pending().then(takes_nothing).wait())
    case("then_takes_two", lambda: pending().then(takes_two).wait())
    case("then_wrong_argument_type", lambda: pending().then(adds_one_to_its_argument).wait())
    case("then_remote_error", lambda: rpc.rpc_async(peer, raise_value_error).then(waits).wait())
    case("then_ok", lambda: pending().then(waits).then(waits).wait())
    # item 9: the agent and the debug info that tools read
    agent = rpc.api._get_current_rpc_agent()
    case(
        "agent_set", lambda: (rpc._is_current_rpc_agent_set(), rpc.api._is_current_rpc_agent_set())
    )
    case("agent_self", lambda: str(agent.get_worker_info()))
    case("agent_by_name", lambda: str(agent.get_worker_info("worker1")))
    case("agent_by_id", lambda: str(agent.get_worker_info(1)))
    case("agent_unknown_name", lambda: agent.get_worker_info("nobody"))
    case("agent_unknown_id", lambda: agent.get_worker_info(9))
    case("agent_all", lambda: [str(w) for w in agent.get_worker_infos()])
    case("agent_debug", lambda: {k: type(v).__name__ for k, v in agent.get_debug_info().items()})
    case("agent_metrics", lambda: sorted(agent.get_metrics()))
    case("debug_info", lambda: {k: type(v).__name__ for k, v in rpc._get_debug_info().items()})
    # item 10: a remote exception that cannot be rebuilt from its message
    case("needs_two", lambda: rpc.rpc_sync(peer, raise_needs_two))
    case("after_needs_two", lambda: rpc.rpc_sync(peer, add_one, (41,)))
    # item 11: async_execution functions that fan out and combine futures
    case("fan_out", lambda: rpc.rpc_sync(peer, fan_out, (everyone, 1)))
    case("fan_out_async", lambda: rpc.rpc_async(peer, fan_out, (everyone, 1)).wait())
    case("fan_out_remote", lambda: rpc.remote(peer, fan_out, (everyone, 1)).to_here())
    case("fan_out_of_fan_outs", lambda: rpc.rpc_sync(peer, fan_out_async, (everyone, 1)))
    case(
        "batch",
        lambda: [f.wait() for f in [rpc.rpc_async(peer, Batcher.submit, (4, i)) for i in range(8)]],
    )
    # item 12: TorchScript functions as RPC targets
    x = torch.ones(2)
    case("script_sync", lambda: rpc.rpc_sync(peer, script_add, (x, 3)).tolist())
    case("script_kwargs", lambda: rpc.rpc_sync(peer, script_add, (x,), {"y": 2}).tolist())
    case("script_async", lambda: rpc.rpc_async(peer, script_add, (x, 1)).wait().tolist())
    case("script_remote", lambda: rpc.remote(peer, script_add, (x, 4)).to_here().tolist())
    case("script_self", lambda: rpc.rpc_sync("worker0", script_add, (x, 5)).tolist())
    case("script_fails", lambda: rpc.rpc_sync(peer, script_fails, (x,)))
    case("script_bad_args", lambda: rpc.rpc_sync(peer, script_add, (x, "a")))
    case("script_async_execution", lambda: rpc.rpc_sync(peer, async_script_add, (x,)).tolist())
    autograd = torch.distributed.autograd if rpc is not distgrad.rpc else distgrad.autograd
    with autograd.context() as context_id:
        leaf = torch.tensor([1.0, 2.0], requires_grad=True)
        out = rpc.rpc_sync(peer, script_add, (leaf * 3, 2))
        autograd.backward(context_id, [(out * out).sum()])
        record["script_gradient"] = {"value": autograd.get_gradients(context_id)[leaf].tolist()}
    return record


def init_errors(rank: int, world_size: int, *, impl: str, port: int) -> dict[str, Outcome]:
    """Bad arguments of ``init_rpc`` and ``WorkerInfo`` (items 7 and 8), one worker."""
    rpc = _use(impl)
    record: dict[str, Outcome] = {}
    init_method = f"tcp://127.0.0.1:{port}"

    class MyOptions(rpc.RpcBackendOptions):  # type: ignore[misc,name-defined]
        pass

    for name in ["", "a b", "w/1", "wörker", "tab\t", "x" * 128, "x" * 127, "A-b_c:9"]:
        record[f"worker_info {name!r}"] = observe(lambda n=name: str(rpc.WorkerInfo(n, 0)))
    record["options_base"] = observe(
        lambda: rpc.init_rpc("w", rank=0, world_size=1, rpc_backend_options=rpc.RpcBackendOptions())
    )
    record["options_subclass"] = observe(
        lambda: rpc.init_rpc("w", rank=0, world_size=1, rpc_backend_options=MyOptions())
    )
    for name in ["bad name!", "x" * 128, ""]:
        opts = rpc.TensorPipeRpcBackendOptions(init_method=init_method)
        record[f"init {name!r}"] = observe(
            lambda n=name, o=opts: rpc.init_rpc(n, rank=0, world_size=1, rpc_backend_options=o)
        )
    opts = rpc.TensorPipeRpcBackendOptions(init_method=init_method)
    record["init 5"] = observe(
        lambda: rpc.init_rpc(5, rank=0, world_size=1, rpc_backend_options=opts)
    )
    record["agent_set_after"] = observe(rpc._is_current_rpc_agent_set)
    record["agent_before_init"] = observe(rpc.api._get_current_rpc_agent)
    record["debug_info_before_init"] = observe(rpc._get_debug_info)
    return record


def own_store(rank: int, world_size: int, *, impl: str, port: int) -> Outcome:
    """A worker started by ``rpc._init_rpc_backend`` on a store it made itself (item 9)."""
    from datetime import timedelta

    import torch.distributed as dist

    rpc = _use(impl)
    store = dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", port, world_size, rank == 0, timeout=timedelta(seconds=30)
    )
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}")
    # as init_rpc does first (torch's RPC refuses calls before it)
    if impl == "torch":
        torch.distributed.autograd._init(rank)
    else:
        distgrad.autograd._init(rank)
    rpc._init_rpc_backend(
        rpc.BackendType.TENSORPIPE, store, f"worker{rank}", rank, world_size, opts
    )
    outcome = observe(lambda: rpc.rpc_sync(f"worker{1 - rank}", add_one, (rank,)))
    rpc.shutdown()
    return outcome


_records: dict[str, dict[str, Outcome]] = {}


def record_of(impl: str) -> dict[str, Outcome]:
    """What ``run`` and ``init_errors`` observed on ``impl`` (each run once per module)."""
    if impl not in _records:
        record = run_workers(run, 3, init=False, timeout=90, kwargs={"impl": impl})[0]
        record.update(run_workers(init_errors, 1, init=False, timeout=60, kwargs={"impl": impl})[0])
        started = run_workers(own_store, 2, init=False, timeout=60, kwargs={"impl": impl})
        record["own_store"] = {"value": [started[0], started[1]]}
        _records[impl] = record
    return _records[impl]


@pytest.fixture(scope="module")
def torch_record() -> dict[str, Outcome]:
    """What torch's RPC did."""
    return record_of("torch")


@pytest.fixture(scope="module")
def distgrad_record() -> dict[str, Outcome]:
    """What distgrad's RPC did."""
    return record_of("distgrad")


Records = tuple[dict[str, Outcome], dict[str, Outcome]]


@pytest.fixture(scope="module")
def both(torch_record: dict[str, Outcome], distgrad_record: dict[str, Outcome]) -> Records:
    """The two records, torch's first."""
    return torch_record, distgrad_record


def same(records: Records, case: str) -> Outcome:
    """Assert that both implementations did the same in ``case`` (messages compared without
    addresses and module names); return distgrad's outcome."""
    torch_outcome, ours = (dict(r[case]) for r in records)
    for outcome in (torch_outcome, ours):
        if "message" in outcome:
            outcome["message"] = normalise(outcome["message"])
    assert ours == torch_outcome, f"{case}:\n torch:    {torch_outcome}\n distgrad: {ours}"
    return records[1][case]


def same_error(records: Records, case: str, until: str | None = None) -> str:
    """Assert both raised the same type with the same message (up to ``until``, if given);
    return distgrad's message."""
    torch_outcome, ours = records[0][case], records[1][case]
    assert "raised" in torch_outcome, torch_outcome
    assert ours.get("raised") == torch_outcome["raised"], f"{case}: {torch_outcome} != {ours}"
    theirs, mine = torch_outcome["message"], ours["message"]
    if until is not None:
        assert until in theirs, theirs
        theirs, mine = theirs[: theirs.index(until)], mine[: len(theirs[: theirs.index(until)])]
    assert normalise(mine) == normalise(theirs), f"{case}:\n torch:    {theirs}\n distgrad: {mine}"
    return str(ours["message"])


# -- item 6: Future.then ------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["then_none", "then_int", "add_done_callback_none"])
def test_then_with_no_callable_raises_torchs_type_error_at_once(both: Records, case: str) -> None:
    """``then(None)`` / ``then(42)`` / ``add_done_callback(None)`` on an rpc_async future
    raise torch's own TypeError at the call, not later elsewhere."""
    message = same_error(both, case, until="Invoked with:")
    assert "incompatible function arguments" in message


@pytest.mark.parametrize("case", ["then_takes_nothing", "then_takes_two"])
def test_callback_of_the_wrong_arity_fails_the_chained_future(both: Records, case: str) -> None:
    """A callback taking no or two arguments fails the chained future with torch's
    RuntimeError ("Got the following error when running the callback: TypeError: ...")."""
    same(both, case)


def test_callback_misusing_its_argument_fails_the_chained_future(both: Records) -> None:
    """A callback that treats the future as a number fails the chained future with torch's
    RuntimeError, message and "At:" frame (only the future's class name differs)."""
    torch_message = both[0]["then_wrong_argument_type"]["message"]
    ours = both[1]["then_wrong_argument_type"]
    assert ours["raised"] == "builtins.RuntimeError"
    assert ours["message"] == torch_message.replace("torch._C.Future", "RpcFuture")


def test_callback_waiting_on_a_failed_call(both: Records) -> None:
    """A callback whose ``wait()`` re-raises a remote ValueError fails the chained future
    with a RuntimeError naming the ValueError and its message, as torch's."""
    prefix = "Got the following error when running the callback: ValueError: "
    for record in both:
        outcome = record["then_remote_error"]
        assert outcome["raised"] == "builtins.RuntimeError", outcome
        assert outcome["message"].startswith(prefix), outcome
        assert "value went wrong" in outcome["message"], outcome
    assert both[1]["then_ok"] == both[0]["then_ok"] == {"value": 2}


# -- item 7: worker names -----------------------------------------------------------------------
@pytest.mark.parametrize("name", ["", "a b", "w/1", "wörker", "tab\t", "x" * 128])
def test_worker_info_refuses_the_names_torch_refuses(both: Records, name: str) -> None:
    """``WorkerInfo(name, 0)`` with a name torch refuses raises torch's RuntimeError."""
    message = same_error(both, f"worker_info {name!r}")
    assert message.startswith("Worker name must match ^[A-Za-z0-9-_:]*$")


@pytest.mark.parametrize("name", ["x" * 127, "A-b_c:9"])
def test_worker_info_accepts_the_names_torch_accepts(both: Records, name: str) -> None:
    """Names of allowed characters under 128 chars are accepted by both."""
    assert same(both, f"worker_info {name!r}")["value"] == f"WorkerInfo(id=0, name={name})"


@pytest.mark.parametrize("name", ["bad name!", "x" * 128, "", 5])
def test_init_rpc_refuses_the_names_torch_refuses(both: Records, name: object) -> None:
    """``init_rpc`` with a name torch refuses raises torch's error, and no agent is left set."""
    same_error(both, f"init {name!r}")
    same(both, "agent_set_after")


# -- item 8: options of no backend --------------------------------------------------------------
@pytest.mark.parametrize("case", ["options_base", "options_subclass"])
def test_options_of_no_backend(both: Records, case: str) -> None:
    """Options that are RpcBackendOptions of no registered backend's type raise torch's
    TypeError "Could not infer backend for options ..."."""
    message = same_error(both, case)
    assert message.startswith("Could not infer backend for options <")


# -- item 9: the agent and debug info -----------------------------------------------------------
@pytest.mark.parametrize(
    "case",
    [
        "agent_set",
        "agent_self",
        "agent_by_name",
        "agent_by_id",
        "agent_unknown_name",
        "agent_unknown_id",
        "agent_debug",
        "agent_metrics",
        "debug_info",
        "agent_before_init",
        "debug_info_before_init",
    ],
)
def test_current_agent_and_debug_info(both: Records, case: str) -> None:
    """``rpc.api._get_current_rpc_agent()`` answers ``get_worker_info`` (self, by name, by
    id, unknown), ``get_debug_info``, ``get_metrics``; ``rpc._get_debug_info()`` has torch's
    keys and value types; before init both raise torch's errors."""
    same(both, case)


def test_init_rpc_backend_on_a_store_of_ones_own(both: Records) -> None:
    """``rpc._init_rpc_backend(backend, store, name, rank, world_size, options)`` starts a
    working group on a TCPStore the program made, as torch's does."""
    assert same(both, "own_store")["value"] == [{"value": 1}, {"value": 2}]


def test_agent_lists_every_worker(both: Records) -> None:
    """``get_worker_infos()`` lists the same workers (torch's order is unspecified)."""
    theirs, ours = (sorted(r["agent_all"]["value"]) for r in both)
    assert ours == theirs == [f"WorkerInfo(id={i}, name=worker{i})" for i in range(3)]


# -- item 10: exceptions that cannot be rebuilt -------------------------------------------------
def test_remote_exception_that_cannot_be_rebuilt(both: Records) -> None:
    """An exception whose constructor needs two arguments arrives as torch's RuntimeError
    naming the original type; the callee serves the next call."""
    message = same_error(both, "needs_two", until="Traceback")
    assert "Original exception on remote side was" in message and "NeedsTwoArgs" in message
    same(both, "after_needs_two")


# -- item 11: async_execution fan-out -----------------------------------------------------------
@pytest.mark.parametrize(
    "case", ["fan_out", "fan_out_async", "fan_out_remote", "fan_out_of_fan_outs", "batch"]
)
def test_async_execution_fan_out_completes(both: Records, case: str) -> None:
    """@async_execution functions that fan out to every worker (the caller and themselves
    included) and combine the futures with collect_all/then -- also nested, also through
    remote(), and the batch pattern of pytorch/examples -- complete with torch's results."""
    assert "value" in same(both, case)


# -- item 12: TorchScript functions -------------------------------------------------------------
@pytest.mark.parametrize(
    "case",
    [
        "script_sync",
        "script_kwargs",
        "script_async",
        "script_remote",
        "script_self",
        "script_async_execution",
        "script_gradient",
    ],
)
def test_script_function_as_rpc_target(both: Records, case: str) -> None:
    """A ``torch.jit.script`` function is an RPC target (sent by qualified name): rpc_sync,
    keyword arguments, rpc_async, remote, a call to self, under @async_execution, and in a
    distributed autograd context (its gradient) give torch's results."""
    assert "value" in same(both, case)


@pytest.mark.parametrize("case", ["script_fails", "script_bad_args"])
def test_script_function_errors(both: Records, case: str) -> None:
    """A TorchScript function that raises, or gets arguments of the wrong type, fails the
    call with torch's RuntimeError and message."""
    same_error(both, case, until="Cast error details" if case == "script_bad_args" else None)
