"""The start-up hook ``distgrad-patch-torch.pth`` (docs/libraries.md): one line that ``site``
executes, doing nothing but an environment lookup when ``DISTGRAD_PATCH_TORCH`` is unset, and
installed with distgrad."""

from __future__ import annotations

import os
import sys
import sysconfig
from pathlib import Path

import pytest

from tests._needs import needs

PTH = Path(__file__).resolve().parents[2] / "src" / "distgrad-patch-torch.pth"


def test_hook_is_one_import_line() -> None:
    """``site`` executes a .pth line only when it starts with ``import``; the hook is that one
    line (nothing else in the file that ``site`` would add to sys.path)."""
    lines = PTH.read_text().splitlines()
    assert len(lines) == 1 and lines[0].startswith("import os;"), lines
    assert "DISTGRAD_PATCH_TORCH" in lines[0] and "except Exception" in lines[0]


def test_hook_does_nothing_when_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the variable unset, running the line imports nothing and changes no import
    machinery."""
    monkeypatch.delenv("DISTGRAD_PATCH_TORCH", raising=False)
    modules, meta_path = set(sys.modules), list(sys.meta_path)
    exec(PTH.read_text())
    assert set(sys.modules) == modules and sys.meta_path == meta_path


PURELIB = Path(sysconfig.get_paths()["purelib"])


@needs(
    None
    if any(PURELIB.glob("distgrad-*.dist-info"))
    else "distgrad is not installed in this environment"
)
def test_installed_distgrad_has_the_hook() -> None:
    """Where distgrad is installed in this environment (regular or editable), its hook is in
    site-packages with this tree's line (CI installs the tree editable: there it must be)."""
    purelib = PURELIB
    infos = sorted(purelib.glob("distgrad-*.dist-info"))
    if PTH.name not in (infos[0] / "RECORD").read_text():
        if os.environ.get("CI"):
            pytest.fail(f"the installed distgrad ({infos[0].name}) has no {PTH.name}")
        pytest.skip("distgrad was installed before the hook existed: reinstall it")
    assert (purelib / PTH.name).read_text() == PTH.read_text()


def test_an_explicit_patch_under_the_variable_warns_nothing() -> None:
    """``DISTGRAD_PATCH_TORCH=1`` and an explicit ``distgrad.patch_torch()`` before torch is
    imported: the patch's own import of torch runs the start-up hook's patch inside it, which
    leaves the work to the call under way (before: a "partially initialized module" warning
    saying the process runs torch's own RPC, while it was patched)."""
    import subprocess

    code = (
        "import distgrad; distgrad.patch_torch(); import torch.distributed.rpc as r; "
        "assert r.__name__ == 'distgrad.rpc' and distgrad.patched(), r.__name__; print('ok')"
    )
    env = {**os.environ, "DISTGRAD_PATCH_TORCH": "1"}
    result = subprocess.run(
        [sys.executable, "-W", "error::RuntimeWarning", "-c", code],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "ok"
    assert "RuntimeWarning" not in result.stderr, result.stderr[-2000:]
