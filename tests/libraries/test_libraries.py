"""Real libraries, unchanged, on distgrad (docs/libraries.md): TorchRL's RPCCollector with its
"mp" launcher, PyG's distributed feature lookup over RPC and fairscale's RPC pipeline with
checkpointing, each run with
``DISTGRAD_PATCH_TORCH=1`` and nothing else changed, and again on torch's own RPC (no
variable) for comparison. Every child reports which RPC it ran.

Marked ``libraries``: the versions in requirements-libraries.txt, installed by
scripts/test_libraries.sh, which sets ``DISTGRAD_REQUIRE_LIBRARIES=1``: there a library that
does not import fails its tests. Elsewhere they are skipped where the libraries are not
installed (scripts/test.sh leaves them out: ``-m "not libraries"``).
"""

from __future__ import annotations

import importlib
import json
import os
import sysconfig
from pathlib import Path

import pytest

from tests._harness import free_port
from tests._patching import REPO, patch_env, run_python

pytestmark = pytest.mark.libraries

HERE = REPO / "tests" / "libraries"


def _env(patch: bool) -> dict[str, str]:
    """The switch through the installed start-up hook when distgrad is installed here (as a
    user has it); else through the tree's hook (tests/_patching.py)."""
    installed = Path(sysconfig.get_paths()["purelib"]) / "distgrad-patch-torch.pth"
    if not installed.exists():
        return patch_env(patch=patch)
    env = dict(os.environ)
    env.pop("DISTGRAD_PATCH_TORCH", None)
    if patch:
        env["DISTGRAD_PATCH_TORCH"] = "1"
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _library(name: str) -> None:
    """Import ``name``: an ImportError fails the test where scripts/test_libraries.sh runs it
    (``DISTGRAD_REQUIRE_LIBRARIES=1``: a broken install must not pass as skips); elsewhere
    the test is skipped."""
    if os.environ.get("DISTGRAD_REQUIRE_LIBRARIES") == "1":
        importlib.import_module(name)
    else:
        pytest.importorskip(name)


def _expected(patch: bool) -> str:
    return "distgrad.rpc" if patch else "torch.distributed.rpc"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("patch", [True, False], ids=["distgrad", "torch"])
def test_torchrl_rpc_collector(tmp_path: Path, patch: bool) -> None:
    """TorchRL 0.14's RPCCollector (mp launcher, two collector nodes) collects all its frames
    in full batches; the trainer and both nodes ran distgrad's RPC under the switch."""
    _library("torchrl")
    result = run_python(
        [str(HERE / "torchrl_rpc_collector.py"), str(free_port()), str(tmp_path), "50"],
        _env(patch),
        timeout=240,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    trainer = json.loads((tmp_path / "trainer.json").read_text())
    nodes = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("node-*.json"))]
    assert trainer == {"rpc": _expected(patch), "agent_set": True, "worker": "TRAINER_NODE"}
    assert sorted(n["worker"] for n in nodes) == ["COLLECTOR_NODE_1", "COLLECTOR_NODE_2"]
    assert all(n["rpc"] == _expected(patch) and n["agent_set"] for n in nodes), nodes


@pytest.mark.timeout(300)
@pytest.mark.parametrize("patch", [True, False], ids=["distgrad", "torch"])
def test_pyg_rpc_feature_lookup(tmp_path: Path, patch: bool) -> None:
    """PyG 2.8's RPC helpers (init_rpc, rpc_partition_to_workers, a LocalFeatureStore lookup
    across two workers, shutdown_rpc) pass; under the switch both workers ran distgrad's RPC
    and PyG's shutdown guard saw distgrad's agent and really shut it down."""
    _library("torch_geometric")
    result = run_python(
        [str(HERE / "pyg_rpc_feature.py"), str(free_port()), str(tmp_path)],
        _env(patch),
        timeout=240,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    for rank in (0, 1):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert report == {
            "rpc": _expected(patch),
            "initialized_before": True,
            "agent_after": False,
        }


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", ["layers", "auto_graph"])
def test_fairscale_distributed_pipeline(tmp_path: Path, case: str) -> None:
    """fairscale 0.4.13's DistributedPipeline with checkpointing, a partition whose outputs
    leave in two RPCs (its Checkpoint node is shared by two send functions and pops its
    recomputation once): two training steps under the switch give torch's RPC's losses and
    parameters."""
    pytest.importorskip("fairscale")
    reports = {}
    for patch in (True, False):
        out = tmp_path / ("distgrad" if patch else "torch")
        out.mkdir()
        result = run_python(
            [str(HERE / "fairscale_pipeline.py"), str(free_port()), str(out), case],
            _env(patch),
            timeout=240,
        )
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
        reports[patch] = json.loads((out / f"{case}.json").read_text())
        assert reports[patch]["rpc"] == _expected(patch)
    ours, theirs = reports[True], reports[False]
    assert ours["losses"] == pytest.approx(theirs["losses"], rel=1e-6)
    assert ours["losses"][1] < ours["losses"][0]
    for a, b in zip(ours["parameters"], theirs["parameters"], strict=True):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-6)
