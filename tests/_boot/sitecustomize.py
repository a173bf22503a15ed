"""Start-up of the test children of the switch's tests (tests/_patching.py puts this folder
on PYTHONPATH): process the repository's ``distgrad-patch-torch.pth`` as an installed
distgrad's site-packages would, and, with ``DISTGRAD_TEST_HIDE_TORCH_RPC=1``, hide torch's
RPC bindings (a torch built without RPC: ``torch.distributed.rpc.is_available()`` is False)."""

from __future__ import annotations

import importlib.abc
import os
import site
import sys
from pathlib import Path

_HIDDEN = ("_rpc_init", "_dist_autograd_init", "_distributed_rpc", "_distributed_autograd")


class _HideTorchRpc(importlib.abc.MetaPathFinder):
    """When ``torch._C`` loads, delete its RPC bindings before torch's __init__ reads them."""

    def find_spec(self, fullname, path, target=None):  # type: ignore[no-untyped-def]
        if fullname != "torch._C":
            return None
        sys.meta_path.remove(self)
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        original = loader.exec_module

        def exec_module(module):  # type: ignore[no-untyped-def]
            original(module)
            for name in _HIDDEN:
                if hasattr(module, name):
                    delattr(module, name)

        loader.exec_module = exec_module
        return spec


if os.environ.get("DISTGRAD_TEST_HIDE_TORCH_RPC") == "1":
    sys.meta_path.insert(0, _HideTorchRpc())
site.addsitedir(str(Path(os.environ["DISTGRAD_TEST_PTH_DIR"])))
