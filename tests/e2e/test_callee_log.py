"""What a callee prints when a Python function called over RPC raises, side by side with torch's
own ``torch.distributed.rpc`` (TensorPipe): ``On WorkerInfo(id=1, name=worker1):``, the
exception's repr and its traceback on the callee's stderr, once per failing call."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests._harness import SRC, free_port

pytestmark = pytest.mark.timeout(180)

# worker0 calls a failing function on worker1 through rpc_sync, rpc_async and remote, and a
# builtin operator that fails on worker1 (printed by neither: torch's builtins run as ops).
PROGRAM = """
import multiprocessing as mp
import sys

import torch

if IMPL == "torch":
    import torch.distributed.rpc as rpc
else:
    import distgrad.rpc as rpc


def fail(x):
    raise ValueError(f"boom {x}")


def worker(rank):
    options = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{PORT}")
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2, rpc_backend_options=options)
    if rank == 0:
        for how in ("sync", "async", "remote"):
            try:
                if how == "sync":
                    rpc.rpc_sync("worker1", fail, args=(how,))
                elif how == "async":
                    rpc.rpc_async("worker1", fail, args=(how,)).wait()
                else:
                    rpc.remote("worker1", fail, args=(how,)).to_here()
            except ValueError:
                print(f"caller got ValueError from {how}", flush=True)
        try:
            rpc.rpc_sync("worker1", torch.matmul, args=(torch.ones(2, 3), torch.ones(2, 3)))
        except RuntimeError:
            print("caller got RuntimeError from the builtin", flush=True)
    rpc.shutdown()


if __name__ == "__main__":
    procs = [mp.get_context("spawn").Process(target=worker, args=(r,)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    sys.exit(max(p.exitcode or 0 for p in procs))
"""


def _run(impl: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    script = tmp_path / f"callee_log_{impl}.py"
    header = f"IMPL = {impl!r}\nPORT = {free_port()}\n"
    script.write_text(header + textwrap.dedent(PROGRAM))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), env.get("PYTHONPATH", "")])
    env.update(TP_SOCKET_IFNAME="lo", TORCH_CPP_LOG_LEVEL="ERROR", PYTHONWARNINGS="ignore")
    return subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=150,
        env=env,
        check=False,
    )


def _printed_errors(stderr: str) -> list[str]:
    """The blocks the callee printed: each from its ``On WorkerInfo`` line to the raise line."""
    blocks = stderr.split("On WorkerInfo(")[1:]
    return ["On WorkerInfo(" + block.split("\n\n")[0] for block in blocks]


@pytest.mark.parametrize("impl", ["torch", "distgrad"])
def test_callee_prints_a_failing_udf_like_torch(impl: str, tmp_path: Path) -> None:
    """A Python function that raises on worker1 -- called by rpc_sync, rpc_async and remote --
    is printed on worker1's stderr as torch prints it: the worker, the repr, the traceback
    down to the raising line; a failing builtin operator is not printed. Run under torch's own
    RPC and under distgrad, with the same assertions."""
    done = _run(impl, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    for how in ("sync", "async", "remote"):
        assert f"caller got ValueError from {how}" in done.stdout, done.stdout + done.stderr
    assert "caller got RuntimeError from the builtin" in done.stdout
    printed = _printed_errors(done.stderr)
    assert len(printed) == 3, done.stderr
    for block, how in zip(sorted(printed), ("async", "remote", "sync"), strict=True):
        assert block.startswith(
            f"On WorkerInfo(id=1, name=worker1):\nValueError('boom {how}')\n"
            "Traceback (most recent call last):\n"
        ), block
        assert 'raise ValueError(f"boom {x}")' in block, block
        assert block.rstrip().endswith(f"ValueError: boom {how}"), block
