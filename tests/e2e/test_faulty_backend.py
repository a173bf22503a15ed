"""End-to-end tests of torch's fault-injecting backend on real worker processes: programs of
torch's own suite (``torch/testing/_internal/distributed/rpc/faulty_agent_rpc_test.py``, its
fixture ``faulty_rpc_agent_test_fixture.py``) with ``torch.distributed.rpc`` swapped for
``distgrad.rpc`` and nothing else changed but the test scaffolding."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from tests._harness import run_workers

# torch's fixture: the retryable message types fail, the call types are delayed
RETRYABLE = [
    "RREF_FORK_REQUEST",
    "RREF_CHILD_ACCEPT",
    "RREF_USER_DELETE",
    "CLEANUP_AUTOGRAD_CONTEXT_REQ",
]
DEFAULT_DELAYS = {"PYTHON_CALL": 1.5, "SCRIPT_CALL": 1.5}


def _init(
    rank: int,
    world_size: int,
    port: int,
    faulty_messages: list[str] | None = None,
    messages_to_delay: dict[str, float] | None = None,
) -> Any:
    """torch's ``dist_init`` with the faulty fixture, on distgrad."""
    import distgrad.rpc as rpc
    import distgrad.rpc._testing  # noqa: F401  (registers FAULTY_TENSORPIPE)

    backend = rpc.backend_registry.BackendType["FAULTY_TENSORPIPE"]
    options = rpc.backend_registry.construct_rpc_backend_options(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        num_worker_threads=8,
        num_fail_sends=3,
        messages_to_fail=RETRYABLE if faulty_messages is None else faulty_messages,
        messages_to_delay=DEFAULT_DELAYS if messages_to_delay is None else messages_to_delay,
    )
    rpc.init_rpc(
        name=f"worker{rank}",
        backend=backend,
        rank=rank,
        world_size=world_size,
        rpc_backend_options=options,
    )
    return rpc


def _flushed(rpc: Any) -> None:
    """torch's ``wait_until_pending_futures_and_users_flushed``."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        info = rpc._rref_context_get_debug_info()
        if int(info["num_pending_futures"]) == 0 and int(info["num_pending_users"]) == 0:
            return
        time.sleep(0.1)
    raise AssertionError(f"pending futures or users not flushed: {info}")


def my_sleep_func(seconds: float = 1) -> torch.Tensor:
    time.sleep(seconds)
    return torch.mul(torch.tensor(1), torch.tensor(1))


def add_rref_to_value(rref: Any, value: Any) -> Any:
    return rref.to_here() + value


def check_failed_messages(rank: int, world_size: int, port: int) -> bool:
    # torch's test_check_failed_messages (messages_to_delay={})
    rpc = _init(rank, world_size, port, messages_to_delay={})
    if rank == 0:
        dst_worker_b = f"worker{(rank + 1) % world_size}"
        dst_worker_c = f"worker{(rank + 2) % world_size}"
        rref = rpc.remote(dst_worker_b, torch.add, args=(torch.ones(2, 2), torch.ones(2, 2)))
        rpc.remote(dst_worker_c, add_rref_to_value, args=(rref, torch.ones(2, 2)))
        assert torch.equal(rref.to_here(), torch.add(torch.ones(2, 2), torch.ones(2, 2)))
    rpc.shutdown()
    return True


def test_check_failed_messages() -> None:
    """Every retryable control message fails its first three sends; the RRef protocol still
    completes (retries) and the workers shut down cleanly."""
    assert run_workers(check_failed_messages, 3, init=False, timeout=90) == {
        0: True,
        1: True,
        2: True,
    }


def remote_message_dropped_timeout(rank: int, world_size: int, port: int, to_self: bool) -> bool:
    # torch's test_builtin_remote_message_dropped_timeout(_to_self)
    rpc = _init(rank, world_size, port, faulty_messages=["SCRIPT_REMOTE_CALL"])
    if rank == 0:
        dst_rank = 0 if to_self else (rank + 1) % world_size
        rref = rpc.remote(f"worker{dst_rank}", torch.add, args=(torch.tensor(1), torch.tensor(1)))
        _flushed(rpc)
        with pytest.raises(RuntimeError, match="RRef creation"):
            rref.to_here()
    rpc.shutdown()
    return True


@pytest.mark.parametrize("to_self", [False, True], ids=["to-peer", "to-self"])
def test_builtin_remote_message_dropped_timeout(to_self: bool) -> None:
    """A SCRIPT_REMOTE_CALL that failed to send leaves an RRef whose to_here raises torch's
    'RRef creation' error."""
    results = run_workers(
        remote_message_dropped_timeout, 2, init=False, timeout=90, kwargs={"to_self": to_self}
    )
    assert results == {0: True, 1: True}


def rref_to_here_timeout(rank: int, world_size: int, port: int) -> bool:
    # torch's test_rref_to_here_timeout
    rpc = _init(
        rank, world_size, port, faulty_messages=[], messages_to_delay={"SCRIPT_RREF_FETCH_CALL": 1}
    )
    if rank == 0:
        dst_worker = f"worker{(rank + 1) % world_size}"
        rref = rpc.remote(dst_worker, torch.add, args=(torch.tensor(1), torch.tensor(1)))
        with pytest.raises(RuntimeError, match="RPC ran for more than"):
            rref.to_here(0.01)
        assert rref.to_here() == 2
    rpc.shutdown()
    return True


def test_rref_to_here_timeout() -> None:
    """A delayed SCRIPT_RREF_FETCH_CALL times out a short to_here; a patient one gets the
    value."""
    assert run_workers(rref_to_here_timeout, 2, init=False, timeout=90) == {0: True, 1: True}


def rpc_builtin_timeout(rank: int, world_size: int, port: int) -> bool:
    # torch's test_rpc_builtin_timeout (SCRIPT_CALL delayed 1.5 s by the fixture's default)
    rpc = _init(rank, world_size, port, faulty_messages=[], messages_to_delay={"SCRIPT_CALL": 1.5})
    dst_worker = f"worker{(rank + 1) % world_size}"
    expected_error = "RPC ran for more than"
    with pytest.raises(RuntimeError, match=expected_error):
        rpc.rpc_sync(dst_worker, torch.add, args=(torch.tensor(1), torch.tensor(1)), timeout=1)
    fut = rpc.rpc_async(dst_worker, torch.add, args=(torch.tensor(1), torch.tensor(1)), timeout=1)
    with pytest.raises(RuntimeError, match=expected_error):
        fut.wait()
    fut = rpc.rpc_async(dst_worker, torch.add, args=(torch.tensor(1), torch.tensor(1)))
    fut.wait()
    rpc._set_rpc_timeout(0.001)
    fut = rpc.rpc_async(dst_worker, torch.add, args=(torch.tensor(1), torch.tensor(1)))
    with pytest.raises(RuntimeError, match=expected_error):
        fut.wait()
    fut = rpc.rpc_async(dst_worker, torch.add, args=(torch.tensor(1), torch.tensor(1)), timeout=0)
    fut.wait()
    rpc._set_rpc_timeout(rpc.constants.DEFAULT_RPC_TIMEOUT_SEC)
    rpc.shutdown()
    return True


def test_rpc_builtin_timeout() -> None:
    """Delayed SCRIPT_CALLs time out under a short timeout (per call or default) and complete
    under the default or no timeout."""
    assert run_workers(rpc_builtin_timeout, 2, init=False, timeout=90) == {0: True, 1: True}


def udf_remote_message_delay_timeout(rank: int, world_size: int, port: int) -> bool:
    # torch's test_udf_remote_message_delay_timeout (PYTHON_REMOTE_CALL delayed 2 s)
    rpc = _init(
        rank, world_size, port, faulty_messages=[], messages_to_delay={"PYTHON_REMOTE_CALL": 2}
    )
    if rank == 0:
        dst_worker = f"worker{(rank + 1) % world_size}"
        rref = rpc.remote(dst_worker, my_sleep_func, args=(2,), timeout=0.001)
        with pytest.raises(RuntimeError, match="RPC ran for more than"):
            rref._get_future().wait()
        _flushed(rpc)
        with pytest.raises(RuntimeError, match="RRef creation"):
            rref.to_here()
        slow_rref = rpc.remote(dst_worker, my_sleep_func, args=(2,), timeout=2)
        with pytest.raises(RuntimeError, match="RPC ran for more than"):
            slow_rref.to_here(0.001)
        # torch's wait_until_owners_and_forks_on_rank(2, 2, rank=1)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            info = rpc.rpc_sync(dst_worker, _debug_info)
            if int(info["num_owner_rrefs"]) == 2 and int(info["num_forks"]) == 2:
                break
            time.sleep(0.1)
        else:
            raise AssertionError(f"owners and forks on worker1: {info}")
    rpc.shutdown()
    return True


def _debug_info() -> dict[str, str]:
    import distgrad.rpc as rpc

    return rpc._rref_context_get_debug_info()


def test_udf_remote_message_delay_timeout() -> None:
    """A remote() whose creation is delayed past its timeout fails its future and later uses,
    and the owner still creates the value and registers the forks."""
    results = run_workers(udf_remote_message_delay_timeout, 2, init=False, timeout=120)
    assert results == {0: True, 1: True}
