"""The once-per-pass rule side by side with torch's RPC, in real processes: the programs of
``tests/_once_programs.py`` (counting and stateful Functions whose outputs leave in 2 and k
RPCs, checkpointing, hooks, fan-out, a 3-stage pipeline with a fan-out and a join, a
re-entrant chain, sparse gradients) run on ``torch.distributed.rpc`` and on distgrad; the
call and hook counts must be equal, and the gradients those of single-process autograd."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests import _once_programs as programs
from tests._harness import run_workers

pytestmark = pytest.mark.timeout(240)

WORLD = 4
#: torch's engine waits forever for the gradient of an unused RPC result
TORCH_HANGS = {"unused_result"}
#: torch's distributed engine never calls a multi-grad hook (the hook asks the engine which of
#: its tensors' nodes the graph task will run, and torch's answer there is none); distgrad
#: calls it once, as local autograd does
TORCH_NEVER_CALLS = {"multi-grad hook"}
CASES = sorted(set(programs.PROGRAMS) | {"checkpoint_reentrant"})


def _counts() -> dict[str, int]:
    counts = dict(programs.COUNTS)
    programs.COUNTS.clear()
    return counts


def _program(name: str) -> Any:
    return programs.PROGRAMS.get(name) or getattr(programs, name)


def worker(rank: int, world_size: int, *, impl: str, port: int) -> dict[str, Any] | None:
    """Run every case on ``impl``; rank 0 reports each case's counts (summed over the
    workers), gradient or error."""
    if impl == "torch":
        import torch.distributed.autograd as dist_autograd
        import torch.distributed.rpc as rpc
    else:
        import distgrad.autograd as dist_autograd  # type: ignore[no-redef]
        import distgrad.rpc as rpc  # type: ignore[no-redef]
    programs.CALL = rpc.rpc_sync
    options = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}")
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size, rpc_backend_options=options)
    report: dict[str, Any] | None = None
    if rank == 0:
        report = {}
        for name in CASES:
            if impl == "torch" and name in TORCH_HANGS:
                continue
            for k in range(world_size):
                rpc.rpc_sync(f"worker{k}", _counts)
            torch.manual_seed(0)
            w = torch.randn(3).requires_grad_()
            outcome: dict[str, Any] = {}
            with dist_autograd.context() as context_id:
                try:
                    dist_autograd.backward(context_id, [_program(name)(w)])
                    outcome["grad"] = dist_autograd.get_gradients(context_id)[w]
                except RuntimeError as exc:
                    outcome["error"] = str(exc)
            total: dict[str, int] = {}
            for k in range(world_size):
                for key, n in rpc.rpc_sync(f"worker{k}", _counts).items():
                    total[key] = total.get(key, 0) + n
            outcome["counts"] = total
            report[name] = outcome
    rpc.shutdown()
    return report


_reports: dict[str, dict[str, Any]] = {}


def report_of(impl: str) -> dict[str, Any]:
    if impl not in _reports:
        result = run_workers(worker, WORLD, init=False, timeout=180, kwargs={"impl": impl})[0]
        assert result is not None
        _reports[impl] = result
    return _reports[impl]


def _without(counts: dict[str, int], keys: set[str]) -> dict[str, int]:
    return {key: n for key, n in counts.items() if key not in keys}


def _local(name: str) -> tuple[torch.Tensor, dict[str, int]]:
    programs.CALL = programs._local_call
    programs.COUNTS.clear()
    torch.manual_seed(0)
    w = torch.randn(3).requires_grad_()
    _program(name)(w).backward()
    assert w.grad is not None
    return w.grad, _counts()


@pytest.mark.parametrize("name", [n for n in CASES if n not in TORCH_HANGS])
def test_counts_equal_torchs_and_gradients_local_autograds(name: str) -> None:
    """Each case: distgrad's counts equal torch's RPC's, and its gradient (or error) too."""
    ours, theirs = report_of("distgrad")[name], report_of("torch")[name]
    assert not TORCH_NEVER_CALLS & set(theirs["counts"])  # (if torch calls it, compare it)
    assert _without(ours["counts"], TORCH_NEVER_CALLS) == theirs["counts"]
    if "error" in theirs:
        assert "error" in ours, "torch's pass failed, distgrad's did not"
        assert "use_reentrant=True" in theirs["error"] and "use_reentrant=True" in ours["error"]
        return
    assert "error" not in ours, ours["error"]
    expected, local_counts = _local(name)
    assert ours["counts"] == local_counts
    torch.testing.assert_close(ours["grad"], expected)
    torch.testing.assert_close(theirs["grad"], expected)


def test_an_unused_result_finishes_with_local_counts() -> None:
    """Where torch's pass waits forever (an RPC result the loss does not use), distgrad's
    finishes, each node once."""
    ours = report_of("distgrad")["unused_result"]
    expected, local_counts = _local("unused_result")
    assert ours["counts"] == local_counts
    torch.testing.assert_close(ours["grad"], expected)
