"""The pickler of the user's choice across real processes: verl's TorchRPC pattern (a
controller creating actors with ``rpc.remote`` on colocated workers and driving them with
closures, lambdas and ``__main__`` classes carrying tensors) runs with dill through torch's
``rpc.api._use_rpc_pickler``; with the default pickler the same program fails as torch's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests._harness import SRC, free_port

SCRIPT = Path(__file__).with_name("verl_pattern.py")
pytest.importorskip("dill")


@pytest.mark.timeout(120)
def test_verls_pattern_runs_with_dill(tmp_path: Path) -> None:
    world, port = 3, free_port()
    env = {**os.environ, "PYTHONPATH": str(SRC), "DISTGRAD_SECRET": "verl-pattern-test"}
    outs = [tmp_path / f"rank{r}.json" for r in range(world)]
    procs = [
        subprocess.Popen(
            [sys.executable, str(SCRIPT), str(r), str(world), str(port), str(outs[r])],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]
    try:
        logs = [p.communicate(timeout=100)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0] * world, "\n".join(logs)
    controller = json.loads(outs[0].read_text())
    assert controller == {
        "rank": 0,
        "closure_ok": True,
        "lambda_ok": True,
        "main_class_ok": True,
        "pickler_restored": True,
    }
