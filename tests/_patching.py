"""Children for the switch's tests: Python processes that start as with an installed
distgrad (its ``.pth`` start-up hook processed), optionally on a torch whose RPC is hidden.

``patch_env(...)`` is the environment: ``tests/_boot`` on ``PYTHONPATH`` (its
``sitecustomize`` processes ``src/distgrad-patch-torch.pth`` and may hide torch's RPC),
``DISTGRAD_PATCH_TORCH`` set or not. Every process the child starts inherits it, as
``torch.multiprocessing.spawn`` children do.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

__all__ = ["REPO", "patch_env", "run_python"]

REPO = Path(__file__).resolve().parent.parent


def patch_env(*, patch: bool, hide_torch_rpc: bool = False) -> dict[str, str]:
    """The environment of a child: the hook processed, the switch on or off."""
    env = dict(os.environ)
    paths = [str(REPO / "tests" / "_boot"), str(REPO / "src"), str(REPO)]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["DISTGRAD_TEST_PTH_DIR"] = str(REPO / "src")
    env.pop("DISTGRAD_PATCH_TORCH", None)
    env.pop("DISTGRAD_TEST_HIDE_TORCH_RPC", None)
    if patch:
        env["DISTGRAD_PATCH_TORCH"] = "1"
    if hide_torch_rpc:
        env["DISTGRAD_TEST_HIDE_TORCH_RPC"] = "1"
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def run_python(
    code_or_args: str | list[str], env: dict[str, str], timeout: float = 120.0
) -> subprocess.CompletedProcess[str]:
    """Run ``python -c code`` (or ``python *args``) in ``env``; bounded by ``timeout``."""
    args = ["-c", code_or_args] if isinstance(code_or_args, str) else code_or_args
    return subprocess.run(
        [sys.executable, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
