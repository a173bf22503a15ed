"""What ``distgrad-patch-torch.pth`` runs at interpreter start-up when ``DISTGRAD_PATCH_TORCH``
is set: patch torch once it is imported (now, if it already is).

The ``.pth`` line reads the variable itself and imports this module only when it is set, so
a process without it pays one dictionary lookup. Nothing here may stop the interpreter from
starting: every failure becomes one warning, and the process runs torch's own RPC.
"""

from __future__ import annotations

import sys
import warnings
from types import ModuleType

from .._config import ENV_PATCH_TORCH, env_flag

__all__ = ["install"]


def _warn(what: str, error: BaseException) -> None:
    warnings.warn(
        f"distgrad: {ENV_PATCH_TORCH} is set but {what} failed ({type(error).__name__}: "
        f"{error}); this process runs torch's own RPC",
        RuntimeWarning,
        stacklevel=2,
    )


def patch_now(_torch: ModuleType | None = None) -> None:
    """Patch torch, turning any failure into a warning (torch is imported by then)."""
    try:
        from ._api import patch_torch

        patch_torch()
    except Exception as error:
        _warn("distgrad.patch_torch()", error)


def install() -> None:
    """Arrange for :func:`patch_now` to run as soon as torch is imported."""
    try:
        if not env_flag(ENV_PATCH_TORCH, False):
            return
        if "torch" in sys.modules:
            patch_now()
            return
        from ._hooks import after_import

        after_import("torch", patch_now)
    except Exception as error:
        _warn("the start-up hook", error)
