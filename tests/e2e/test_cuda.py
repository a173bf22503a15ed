"""CUDA over RPC on one GPU (two processes sharing ``cuda:0``), side by side with torch's RPC
(TensorPipe): the cases of torch's TensorPipeAgentCudaRpcTest, TensorPipeCudaDistAutogradTest
and CudaRemoteModuleTest that one GPU can run. Skipped without CUDA (CI never has one);
``scripts/gpu_check.sh`` runs them on a GPU machine.

Each implementation runs the whole list once, in one fresh 2-worker group (module fixture);
every case records plain data (values, devices, exception types and messages), and each test
checks one case on distgrad -- and that torch's RPC observed the same where it is compared.

Maps: worker0 -> worker1 ``{cuda:0: cuda:0}``; worker1 -> worker0 ``{cpu: cuda:0}`` (so worker1's
CPU tensors land on worker0's GPU and come back to worker1's CPU by the inverse map).
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed.rpc.functions as torch_functions

import distgrad.rpc.functions as distgrad_functions
from tests._harness import run_workers

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.timeout(300),
]

MAPS = {0: {"worker1": {"cuda:0": "cuda:0"}}, 1: {"worker0": {"cpu": "cuda:0"}}}
SLEEP_CYCLES = 200_000_000  # ~0.1 s of GPU time: long enough to expose a missing stream wait
_rpc: dict[str, Any] = {}


def _use(impl: str) -> Any:
    if impl == "torch":
        import torch.distributed.rpc as rpc
    else:
        import distgrad.rpc as rpc  # type: ignore[no-redef]
    _rpc["rpc"] = rpc
    return rpc


def _autograd(impl: str) -> Any:
    if impl == "torch":
        import torch.distributed.autograd as dist_autograd
    else:
        import distgrad.autograd as dist_autograd  # type: ignore[no-redef]
    return dist_autograd


# -- functions the callee runs -------------------------------------------------------------------
def add_and_report(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, str, str]:
    return x + y, str(x.device), str(y.device)


def echo(x: Any) -> Any:
    return x


def slow_double(x: torch.Tensor) -> torch.Tensor:
    """Work queued on the callee's current stream behind ~0.1 s of GPU sleep."""
    torch.cuda._sleep(SLEEP_CYCLES)
    return x * 2


def make_on_cuda() -> torch.Tensor:
    return torch.ones(3, device="cuda:0")


def view_of(x: torch.Tensor) -> torch.Tensor:
    return x[1:3]


def device_of(x: torch.Tensor) -> str:
    return str(x.device)


def rref_sum(rref: Any) -> torch.Tensor:
    return rref.to_here().sum()


def _async_add_one(x: torch.Tensor) -> Any:
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future(devices=[x.device])
    with torch.cuda.stream(torch.cuda.Stream(x.device)):
        torch.cuda._sleep(SLEEP_CYCLES)
        future.set_result(x + 1)
    return future


@torch_functions.async_execution
def async_add_one_torch(x: torch.Tensor) -> Any:
    return _async_add_one(x)


@distgrad_functions.async_execution
def async_add_one_distgrad(x: torch.Tensor) -> Any:
    return _async_add_one(x)


def _async_target(impl: str) -> Any:
    return async_add_one_torch if impl == "torch" else async_add_one_distgrad


# -- the cases -----------------------------------------------------------------------------------
def _error(exc: BaseException) -> dict[str, Any]:
    return {"raised": type(exc).__name__, "message": str(exc)}


def _cases_worker0(impl: str) -> dict[str, Callable[[], Any]]:
    rpc = _rpc["rpc"]
    dist_autograd = _autograd(impl)
    cuda = torch.device("cuda:0")

    def gpu_to_gpu() -> Any:
        x, y = torch.ones(4, device=cuda), torch.full((4,), 2.0, device=cuda)
        out, dx, dy = rpc.rpc_sync("worker1", add_and_report, (x, y))
        return {"device": str(out.device), "value": out.cpu().tolist(), "callee": [dx, dy]}

    def custom_stream_sender() -> Any:
        # the tensor is written on a side stream behind a GPU sleep: the send must wait for it
        stream = torch.cuda.Stream(cuda)
        x = torch.zeros(1 << 20, device=cuda)
        with torch.cuda.stream(stream):
            torch.cuda._sleep(SLEEP_CYCLES)
            x.fill_(7.0)
            back = rpc.rpc_sync("worker1", echo, (x,))
            total = back.sum().item()  # on the current (side) stream: safe after the call
        return {"sum": total, "device": str(back.device)}

    def callee_stream() -> Any:
        back = rpc.rpc_sync("worker1", slow_double, (torch.ones(1 << 20, device=cuda),))
        return {"sum": back.sum().item()}

    def async_wait() -> Any:
        future = rpc.rpc_async("worker1", slow_double, (torch.ones(1 << 20, device=cuda),))
        value = future.wait()
        return {"sum": value.sum().item(), "device": str(value.device)}

    def then_callback() -> Any:
        future = rpc.rpc_async("worker1", slow_double, (torch.ones(8, device=cuda),))
        chained = future.then(lambda done: done.value() + 1)
        return {"value": chained.wait().cpu().tolist()}

    def no_map_request() -> Any:  # worker0 has no map to itself
        try:
            rpc.rpc_sync("worker0", echo, (torch.ones(2, device=cuda),))
        except Exception as exc:
            return _error(exc)
        return "sent"

    def no_map_response() -> Any:
        try:
            rpc.rpc_sync("worker0", make_on_cuda)
        except Exception as exc:
            return _error(exc)
        return "answered"

    def usable_after_errors() -> Any:
        return rpc.rpc_sync("worker1", torch.add, (torch.ones(2, device=cuda), 1)).cpu().tolist()

    def view_as_return() -> Any:
        x = torch.arange(6.0, device=cuda)
        back = rpc.rpc_sync("worker1", view_of, (x,))
        return {"value": back.cpu().tolist(), "device": str(back.device)}

    def big_echo() -> Any:
        x = torch.randint(0, 255, (64 << 20,), dtype=torch.uint8, device=cuda)
        return {"equal": bool(torch.equal(rpc.rpc_sync("worker1", echo, (x,)), x))}

    def rref() -> Any:
        ref = rpc.remote("worker1", torch.add, (torch.ones(3, device=cuda), 1))
        fetched = ref.to_here()
        total = rpc.rpc_sync("worker1", rref_sum, (ref,))
        return {
            "value": fetched.cpu().tolist(),
            "device": str(fetched.device),
            "sum": total.item(),
        }

    def async_execution() -> Any:
        x = torch.ones(4, device=cuda)
        back = rpc.rpc_sync("worker1", _async_target(impl), (x,))
        return {"value": back.cpu().tolist(), "device": str(back.device)}

    def dist_autograd_backward() -> Any:
        w = torch.tensor([1.0, -2.0, 3.0], device=cuda, requires_grad=True)
        with dist_autograd.context() as ctx:
            out = rpc.rpc_sync("worker1", torch.mul, (w, w))
            loss = (out * 3).sum()
            dist_autograd.backward(ctx, [loss])
            grad = dist_autograd.get_gradients(ctx)[w]
            return {"grad": grad.cpu().tolist(), "device": str(grad.device)}

    def remote_module() -> Any:
        if impl == "torch":
            from torch.distributed.nn import RemoteModule
        else:
            from distgrad.nn import RemoteModule  # type: ignore[no-redef]
        torch.manual_seed(0)
        module = RemoteModule("worker1/cuda:0", torch.nn.Linear, (4, 2))
        x = torch.randn(3, 4, device=cuda)
        out = module(x)
        params = [p.to_here() for p in module.remote_parameters()]
        want = torch.nn.functional.linear(x, params[0], params[1])
        return {"device": str(out.device), "close": bool(torch.allclose(out, want))}

    return {
        "gpu_to_gpu": gpu_to_gpu,
        "custom_stream_sender": custom_stream_sender,
        "callee_stream": callee_stream,
        "async_wait": async_wait,
        "then_callback": then_callback,
        "no_map_request": no_map_request,
        "no_map_response": no_map_response,
        "usable_after_errors": usable_after_errors,
        "view_as_return": view_as_return,
        "big_echo": big_echo,
        "rref": rref,
        "async_execution": async_execution,
        "dist_autograd_backward": dist_autograd_backward,
        "remote_module": remote_module,
    }


def _cases_worker1(impl: str) -> dict[str, Callable[[], Any]]:
    rpc = _rpc["rpc"]

    def cpu_to_gpu() -> Any:
        back = rpc.rpc_sync("worker0", add_and_report, (torch.ones(2), torch.ones(2)))
        out, dx, dy = back
        return {"device": str(out.device), "value": out.tolist(), "callee": [dx, dy]}

    def map_lacks_device() -> Any:
        try:
            rpc.rpc_sync("worker0", echo, (torch.ones(2, device="cuda:0"),))
        except Exception as exc:
            return _error(exc)
        return "sent"

    return {"cpu_to_gpu": cpu_to_gpu, "map_lacks_device": map_lacks_device}


def cuda_program(rank: int, world_size: int, port: int, impl: str) -> dict[str, Any]:
    rpc = _use(impl)
    options = rpc.TensorPipeRpcBackendOptions(
        init_method=f"tcp://127.0.0.1:{port}", rpc_timeout=60, device_maps=MAPS[rank]
    )
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size, rpc_backend_options=options)
    seen: dict[str, Any] = {}
    cases = _cases_worker0(impl) if rank == 0 else _cases_worker1(impl)
    for name, case in cases.items():
        try:
            seen[name] = case()
        except Exception as exc:
            seen[name] = {"failed": f"{type(exc).__name__}: {exc}", "tb": traceback.format_exc()}
    rpc.shutdown()
    return seen


@pytest.fixture(scope="module")
def observed() -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for impl in ("torch", "distgrad"):
        results = run_workers(cuda_program, 2, init=False, timeout=240, kwargs={"impl": impl})
        out[impl] = {**results[0], **results[1]}
    return out


def _ours(observed: dict[str, dict[str, Any]], case: str) -> Any:
    value = observed["distgrad"][case]
    assert not (isinstance(value, dict) and "failed" in value), value
    return value


def _same(observed: dict[str, dict[str, Any]], case: str) -> Any:
    ours = _ours(observed, case)
    assert ours == observed["torch"][case], (ours, observed["torch"][case])
    return ours


def test_gpu_tensors_land_by_the_map_and_return_by_the_reverse(observed: Any) -> None:
    """cuda:0 -> cuda:0: the callee gets its arguments on cuda:0, the result comes back on
    cuda:0 with the right values (torch: test_device_maps_gpu)."""
    assert _same(observed, "gpu_to_gpu") == {
        "device": "cuda:0",
        "value": [3.0] * 4,
        "callee": ["cuda:0", "cuda:0"],
    }


def test_cpu_tensors_follow_a_cpu_entry(observed: Any) -> None:
    """worker1's ``cpu -> cuda:0``: CPU arguments land on worker0's GPU, and the GPU result
    comes back to worker1's CPU by the inverse map (test_device_map_cpu_to_gpu)."""
    assert _same(observed, "cpu_to_gpu") == {
        "device": "cpu",
        "value": [2.0, 2.0],
        "callee": ["cuda:0", "cuda:0"],
    }


def test_the_send_waits_for_the_senders_current_stream(observed: Any) -> None:
    """A tensor written on a side stream behind a GPU sleep is sent with its final values
    (test_custom_stream)."""
    assert _same(observed, "custom_stream_sender") == {"sum": 7.0 * (1 << 20), "device": "cuda:0"}


def test_the_callees_work_is_complete_in_the_reply(observed: Any) -> None:
    """The callee's result, computed on its stream behind a GPU sleep, arrives complete."""
    assert _same(observed, "callee_stream") == {"sum": 2.0 * (1 << 20)}


def test_future_wait_makes_the_current_stream_safe(observed: Any) -> None:
    """rpc_async's wait() returns a tensor safe on the current stream; then() callbacks see
    complete values (test_cuda_future_*)."""
    assert _same(observed, "async_wait") == {"sum": 2.0 * (1 << 20), "device": "cuda:0"}
    assert _same(observed, "then_callback") == {"value": [3.0] * 8}


def test_missing_maps_give_torchs_errors_and_the_agent_stays_usable(observed: Any) -> None:
    """No map to the destination: a request fails at once, a response comes back as the
    call's error, a map without the tensor's device fails with torch's message; later calls
    work (test_device_maps_missing_config*, test_device_mismatch)."""
    request = _ours(observed, "no_map_request")
    assert request["raised"] == "RuntimeError"
    assert request["message"].endswith(
        "Request device mapping is not available for destination worker0, but found tensor on "
        "device: cuda:0"
    )
    response = _ours(observed, "no_map_response")
    assert "Response device mapping is not available for destination worker0" in response["message"]
    lacking = _ours(observed, "map_lacks_device")
    assert lacking["message"].endswith(
        "Request device mapping is not available for destination worker0 for device cuda:0 but "
        "received a tensor on that device."
    )
    assert _same(observed, "usable_after_errors") == [2.0, 2.0]
    for case in ("no_map_request", "map_lacks_device"):
        assert observed["torch"][case]["message"] in (observed["distgrad"][case]["message"],)


def test_views_big_tensors_and_rrefs(observed: Any) -> None:
    """A view returned by the callee has its values (test_tensor_view_as_return_value); 64 MiB
    come back bit-exact; remote() arguments and to_here() move by the maps, and an RRef
    argument is usable on the owner (test_rref_*)."""
    assert _same(observed, "view_as_return") == {"value": [1.0, 2.0], "device": "cuda:0"}
    assert _same(observed, "big_echo") == {"equal": True}
    assert _same(observed, "rref") == {"value": [2.0] * 3, "device": "cuda:0", "sum": 6.0}


def test_async_execution_with_a_cuda_future(observed: Any) -> None:
    """An async_execution function returning a CUDA future completed on a side stream: the
    caller gets the complete value (test_async_execution_with_cuda_future)."""
    assert _same(observed, "async_execution") == {"value": [2.0] * 4, "device": "cuda:0"}


def test_distributed_backward_on_the_gpu(observed: Any) -> None:
    """Gradients travel back by the inverse of the forward's map and land on the leaf's
    device, equal to local autograd's (TensorPipeCudaDistAutogradTest)."""
    assert _same(observed, "dist_autograd_backward") == {
        "grad": [6.0, -12.0, 18.0],
        "device": "cuda:0",
    }


def test_remote_module_on_cuda(observed: Any) -> None:
    """A RemoteModule on worker1/cuda:0 with CUDA inputs returns CUDA outputs equal to the
    local computation (CudaRemoteModuleTest)."""
    assert _same(observed, "remote_module") == {"device": "cuda:0", "close": True}
