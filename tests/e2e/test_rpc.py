"""RPC calls end to end: real workers over real sockets on 127.0.0.1."""

from __future__ import annotations

import re
import time

import pytest
import torch

import distgrad.rpc as rpc
from tests._harness import WorkerFailure as ClusterError
from tests._harness import free_port
from tests._harness import run_workers as run_cluster

pytestmark = pytest.mark.timeout(120)


class CustomError(Exception):
    """An exception type that lives in this module."""


def identity(x: object) -> object:
    return x


def add(a: object, b: object = 0, *, scale: int = 1) -> object:
    return (a + b) * scale  # type: ignore[operator]


def raise_value_error() -> None:
    raise ValueError("value went wrong")


def raise_key_error() -> None:
    raise KeyError("missing")


def raise_custom() -> None:
    raise CustomError("custom went wrong")


def return_lambda() -> object:
    return lambda: 1


def return_future() -> torch.futures.Future[int]:
    fut: torch.futures.Future[int] = torch.futures.Future()
    fut.set_result(1)
    return fut


def sleep_then(seconds: float, value: object = None) -> object:
    time.sleep(seconds)
    return value


def nested_ring(hops: list[str], x: torch.Tensor) -> torch.Tensor:
    if not hops:
        return x + 1
    return rpc.rpc_sync(hops[0], nested_ring, (hops[1:], x + 1))


@rpc.functions.async_execution
def async_add_chain(dst: str, x: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    return rpc.rpc_async(dst, torch.add, (x, 1)).then(lambda fut: fut.wait() * 2)


@rpc.functions.async_execution
def async_wrong_return(x: int) -> int:
    return x


def everyone_calls_everyone(rank: int, world_size: int) -> int:
    me = rpc.get_worker_info()
    assert me.id == rank and me.name == f"worker{rank}"
    calls = 0
    for peer in range(world_size):
        info = rpc.get_worker_info(f"worker{peer}")
        assert info == rpc.WorkerInfo(f"worker{peer}", peer)
        for to in (f"worker{peer}", peer, info):
            x = torch.full((3,), float(rank))
            assert torch.equal(rpc.rpc_sync(to, torch.add, (x, peer)), x + peer)
            assert rpc.rpc_sync(to, add, (rank, peer), {"scale": 3}) == (rank + peer) * 3
            fut = rpc.rpc_async(to, add, (x,), {"b": x})
            assert torch.equal(fut.wait(), 2 * x)
            calls += 3
    with rpc.api._wait_all():
        futures = [rpc.rpc_async(f"worker{p}", identity, (p,)) for p in range(world_size)]
    assert all(f.done() for f in futures)
    assert [f.value() for f in futures] == list(range(world_size))
    return calls


def test_all_to_all_calls() -> None:
    """4 workers call every worker (itself included) with builtins and Python functions, args
    and kwargs, ``to`` as name, rank and WorkerInfo, sync and async; ``_wait_all`` collects."""
    results = run_cluster(everyone_calls_everyone, 4, timeout=90)
    assert results == {r: 36 for r in range(4)}


def payload_program(rank: int, world_size: int) -> str:
    if rank != 0:
        return "idle"
    big = torch.randint(0, 256, (64 * 1024 * 1024,), dtype=torch.uint8)
    back = rpc.rpc_sync("worker1", identity, (big,))
    assert torch.equal(back, big)
    dtypes = [
        torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
        torch.float16, torch.bfloat16, torch.float32, torch.float64,
        torch.complex64, torch.complex128,
    ]  # fmt: skip
    for dtype in dtypes:
        x = (torch.randn(7, 5) * 100).to(dtype)
        y = rpc.rpc_sync("worker1", identity, (x,))
        assert y.dtype == dtype and torch.equal(x, y), dtype
    base = torch.randn(6, 8)
    for view in (base.t(), base[::2, 1::3], base[2], base.expand(2, 6, 8), torch.tensor(3.5)):
        y = rpc.rpc_sync("worker1", identity, (view,))
        assert torch.equal(y, view) and y.shape == view.shape
    sparse = torch.sparse_coo_tensor(torch.tensor([[0, 2, 2], [1, 0, 3]]), torch.randn(3), (4, 5))
    y = rpc.rpc_sync("worker1", identity, (sparse,))
    assert y.is_sparse and torch.equal(y.to_dense(), sparse.to_dense())
    leaf = torch.randn(3, requires_grad=True)
    assert rpc.rpc_sync("worker1", identity, (leaf.detach().requires_grad_(),)).requires_grad
    nested = {"a": [base, (leaf.detach(), "text")], "b": None}
    got = rpc.rpc_sync("worker1", identity, (nested,))
    assert torch.equal(got["a"][0], base) and got["a"][1][1] == "text"
    return "ok"


def test_tensor_payloads_round_trip_bit_exact() -> None:
    """A 64 MiB tensor, every dtype, views, 0-d, sparse COO, nested containers and
    requires_grad survive a round trip bit-exact."""
    assert run_cluster(payload_program, 2, timeout=90)[0] == "ok"


def error_program(rank: int, world_size: int) -> str:
    if rank != 0:
        return "idle"
    for fn, kind, text in (
        (raise_value_error, ValueError, "value went wrong"),
        (raise_key_error, KeyError, "missing"),
        (raise_custom, CustomError, "custom went wrong"),
    ):
        with pytest.raises(kind) as info:
            rpc.rpc_sync("worker1", fn)
        message = str(info.value)
        assert text in message and "Traceback" in message and fn.__name__ in message
        assert "On WorkerInfo(id=1, name=worker1):" in message
        with pytest.raises(kind):
            rpc.rpc_async("worker1", fn).wait()
    with pytest.raises(RuntimeError, match="could not find destination name nobody"):
        rpc.rpc_sync("nobody", identity, (1,))
    with pytest.raises(TypeError, match=re.escape("function should be callable.")):
        rpc.rpc_sync("worker1", 42, ())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=re.escape("Cannot get WorkerInfo from name 1.5")):
        rpc.rpc_sync(1.5, identity, (1,))  # type: ignore[arg-type]
    with pytest.raises(Exception, match=r"pickle|Pickl"):
        rpc.rpc_sync("worker1", identity, (lambda: 1,))
    with pytest.raises(Exception, match=r"pickle|Pickl|lambda"):
        rpc.rpc_sync("worker1", return_lambda)
    with pytest.raises(RuntimeError, match=re.escape("Can not pickle torch.futures.Future")):
        rpc.rpc_sync("worker1", return_future)
    with pytest.raises(
        RuntimeError,
        match=re.escape("must return a torch.futures.Future object, but got builtins.int"),
    ):
        rpc.rpc_sync("worker1", async_wrong_return, (1,))
    # after all that, the worker keeps serving
    assert rpc.rpc_sync("worker1", add, (2, 3)) == 5
    return "ok"


def test_remote_errors_keep_type_and_traceback() -> None:
    """Remote exceptions keep their type and carry the remote traceback; bad destinations,
    uncallables and unpicklable arguments or results give the reference's errors, and the
    worker keeps serving."""
    assert run_cluster(error_program, 2, timeout=60)[0] == "ok"


def udf_only_here(x: int) -> int:
    return x


def missing_udf_program(rank: int, world_size: int) -> str:
    if rank == 0:
        # worker1 cannot import this function: it lives in a module only worker0 has
        import sys
        import types

        module = types.ModuleType("only_on_worker0")
        exec("def f(x):\n    return x\n", module.__dict__)
        sys.modules["only_on_worker0"] = module
        with pytest.raises(RuntimeError, match="Ensure that UDFs are defined on both"):
            rpc.rpc_sync("worker1", module.f, (1,))
        assert rpc.rpc_sync("worker1", udf_only_here, (7,)) == 7
    rpc.api._barrier()
    return "ok"


def test_function_missing_on_callee() -> None:
    """A function the callee can't import gives the reference's error; the callee keeps serving."""
    assert run_cluster(missing_udf_program, 2, timeout=60)[0] == "ok"


def nested_program(rank: int, world_size: int) -> str:
    if rank != 0:
        rpc.api._barrier()
        return "idle"
    x = torch.zeros(2)
    assert torch.equal(rpc.rpc_sync("worker1", nested_ring, (["worker2", "worker0"], x)), x + 3)
    # more concurrent nested calls than worker threads on the first hop
    futures = [
        rpc.rpc_async("worker1", nested_ring, (["worker2", "worker0", "worker1"], x))
        for _ in range(12)
    ]
    assert all(torch.equal(f.wait(), x + 4) for f in futures)
    assert torch.equal(rpc.rpc_sync("worker1", async_add_chain, ("worker2", x)), (x + 1) * 2)
    rpc.api._barrier()
    return "ok"


def test_nested_calls_do_not_deadlock() -> None:
    """Nested rings 0->1->2->0 and 12 concurrent nested calls with 4 worker threads complete;
    ``@async_execution`` functions reply when their future completes."""
    results = run_cluster(nested_program, 3, timeout=90, options={"num_worker_threads": 4})
    assert results[0] == "ok"


def timeout_program(rank: int, world_size: int) -> str:
    if rank != 0:
        rpc.api._barrier()
        return "idle"
    assert rpc.get_rpc_timeout() == 60.0
    with pytest.raises(RuntimeError, match="RPC ran for more than set timeout"):
        rpc.rpc_sync("worker1", sleep_then, (2.0,), timeout=0.2)
    started = time.monotonic()
    fut = rpc.rpc_async("worker1", sleep_then, (2.0,), timeout=0.3)
    with pytest.raises(
        RuntimeError, match=re.escape("RPCErr:1:RPC ran for more than set timeout (300 ms)")
    ):
        fut.wait()
    assert time.monotonic() - started < 1.5
    rpc._set_rpc_timeout(0.25)
    assert rpc.get_rpc_timeout() == 0.25
    with pytest.raises(RuntimeError, match="RPC ran for more than set timeout"):
        rpc.rpc_sync("worker1", sleep_then, (2.0,))
    assert rpc.rpc_sync("worker1", sleep_then, (0.5, "slow"), timeout=0) == "slow"  # 0 = none
    rpc._set_rpc_timeout(60.0)
    assert rpc.rpc_sync("worker1", add, (1, 1)) == 2
    rpc.api._barrier()
    return "ok"


def test_timeouts() -> None:
    """Per-call and default timeouts with the reference's message; 0 means no timeout."""
    assert run_cluster(timeout_program, 2, timeout=60)[0] == "ok"


def duplicate_name_program(rank: int, world_size: int, port: int) -> str:
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}", rpc_timeout=20)
    with pytest.raises(RuntimeError, match="is not unique"):
        rpc.init_rpc("same-name", rank=rank, world_size=world_size, rpc_backend_options=opts)
    with pytest.raises(RuntimeError, match="RPC has not been initialized"):
        rpc.rpc_sync("same-name", add, (1, 1))
    return "ok"


def test_duplicate_worker_names() -> None:
    """Two workers with one name both fail init with the reference's message."""
    assert run_cluster(duplicate_name_program, 2, init=False, timeout=60) == {0: "ok", 1: "ok"}


def reinit_program(rank: int, world_size: int, port: int) -> str:
    import os

    with pytest.raises(
        RuntimeError,
        match=re.escape("RPC has not been initialized. Call torch.distributed.rpc.init_rpc first."),
    ):
        rpc.get_worker_info()
    with pytest.raises(RuntimeError, match="Worker name must match"):
        rpc.init_rpc("bad name!", rank=rank, world_size=world_size)
    with pytest.raises(TypeError, match="Argument backend must be a member of BackendType"):
        rpc.init_rpc("w", backend="tensorpipe", rank=rank, world_size=world_size)
    # env:// with torchrun's variables and no rank/world_size arguments
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size)
    )
    rpc.init_rpc(f"worker{rank}")
    with pytest.raises(RuntimeError, match="RPC is already initialized"):
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size)
    assert rpc.rpc_sync(f"worker{1 - rank}", add, (rank, 1)) == rank + 1
    rpc.shutdown()
    # again, through file://, on the same processes
    path = f"/tmp/distgrad-test-{port}"
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"file://{path}")
    rpc.init_rpc(f"again{rank}", rank=rank, world_size=world_size, rpc_backend_options=opts)
    assert rpc.rpc_sync(f"again{1 - rank}", add, (rank, 2)) == rank + 2
    rpc.shutdown()
    return "ok"


def test_init_forms_and_reinit_after_shutdown() -> None:
    """env:// from torchrun's variables, file://, init again after shutdown, and the
    reference's errors for bad names, bad backends, double init and use before init."""
    port = free_port()
    results = run_cluster(reinit_program, 2, init=False, timeout=90, kwargs={})
    assert results == {0: "ok", 1: "ok"}
    assert port  # the helper allocates its own port; this one only proves free_port works


def graceful_program(rank: int, world_size: int) -> str:
    if rank == 0:
        futures = [rpc.rpc_async(f"worker{r}", sleep_then, (0.5, r)) for r in range(1, world_size)]
        # a callee starts a follow-up call it does not wait for; shutdown must drain it too
        rpc.rpc_sync("worker1", fire_and_forget, ("worker2",))
        rpc.shutdown()
        assert [f.wait() for f in futures] == list(range(1, world_size))
        assert FOLLOW_UPS == []
        return "ok"
    rpc.shutdown()
    return "ok"


FOLLOW_UPS: list[object] = []


def fire_and_forget(dst: str) -> None:
    FOLLOW_UPS.append(rpc.rpc_async(dst, sleep_then, (0.5,)))


def test_graceful_shutdown_drains_calls_in_flight() -> None:
    """Calls in flight at shutdown, and follow-up calls they start, all complete before any
    worker's graceful shutdown returns."""
    results = run_cluster(graceful_program, 4, timeout=60, shutdown=False)
    assert set(results.values()) == {"ok"}


def stubborn_program(rank: int, world_size: int) -> str:
    if rank == 1:
        time.sleep(6)  # never calls shutdown within worker0's timeout
        rpc.shutdown(graceful=False)
        return "late"
    started = time.monotonic()
    with pytest.raises(RuntimeError):
        rpc.shutdown(timeout=1.0)
    assert time.monotonic() - started < 3.0
    with pytest.raises(RuntimeError, match="RPC has not been initialized"):
        rpc.get_worker_info()
    return "ok"


def test_shutdown_timeout_bounds_the_wait() -> None:
    """shutdown(timeout=...) with a peer that never shuts down raises within the bound and
    leaves the agent reset."""
    results = run_cluster(stubborn_program, 2, timeout=60, shutdown=False)
    assert results == {0: "ok", 1: "late"}


def test_harness_reports_worker_failures() -> None:
    """The harness itself: a failing worker fails the test with its traceback."""
    with pytest.raises(ClusterError, match="value went wrong"):
        run_cluster(_fail_on_worker1, 2, timeout=60)


def _fail_on_worker1(rank: int, world_size: int) -> None:
    if rank == 1:
        raise_value_error()
    rpc.api._barrier()
