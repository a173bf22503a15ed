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
