"""Build hooks (the project's metadata is in pyproject.toml): ship the start-up hook
``distgrad-patch-torch.pth`` at the top of site-packages, for regular and editable installs.

The hook makes ``DISTGRAD_PATCH_TORCH=1`` work in every Python process (docs/libraries.md).
Editable installs go through setuptools' ``editable_wheel``; where a setuptools lacks the
method used to add the file there, the install still works, without the hook.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "distgrad-patch-torch.pth"
SOURCE = Path(__file__).resolve().parent / "src" / PTH


class BuildPyWithPth(build_py):
    """build_py, plus the hook at the top of the build tree (wheels install it there)."""

    def run(self) -> None:
        super().run()
        if not self.editable_mode:
            self.copy_file(str(SOURCE), str(Path(self.build_lib) / PTH), preserve_mode=False)

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        outputs = list(super().get_outputs(include_bytecode))
        if not self.editable_mode:
            outputs.append(str(Path(self.build_lib) / PTH))
        return outputs


class _StrategyWithPth:
    """An editable-install strategy that also writes the hook into the wheel's top."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __call__(self, wheel: Any, files: Any, mapping: Any) -> None:
        self.inner(wheel, files, mapping)
        wheel.writestr(PTH, SOURCE.read_bytes())

    def __enter__(self) -> _StrategyWithPth:
        self.inner.__enter__()
        return self

    def __exit__(self, *exc: object) -> Any:
        return self.inner.__exit__(*exc)


cmdclass: dict[str, Any] = {"build_py": BuildPyWithPth}
try:
    from setuptools.command.editable_wheel import editable_wheel
except ImportError:  # a setuptools without PEP 660 editable installs
    editable_wheel = None
if editable_wheel is not None and hasattr(editable_wheel, "_select_strategy"):

    class EditableWheelWithPth(editable_wheel):  # type: ignore[misc, valid-type]
        def _select_strategy(self, *args: Any, **kwargs: Any) -> Any:
            return _StrategyWithPth(super()._select_strategy(*args, **kwargs))

    cmdclass["editable_wheel"] = EditableWheelWithPth

setup(cmdclass=cmdclass)
