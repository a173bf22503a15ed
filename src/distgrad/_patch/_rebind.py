"""Rebinding names that modules took from torch's RPC before the switch.

``from torch.distributed.rpc import RRef`` in a module imported before ``patch_torch()``
(torch's own DDP and TorchScript modules do this inside ``import torch``) holds torch's
class, not the module. The table maps each such object of torch's RPC to distgrad's of the
same name; the sweep replaces, in every loaded module's globals, the values found in it.
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Any

__all__ = ["Table"]

# objects of these modules are torch's RPC (a class or function defined there, a module)
_RPC_MODULES = (
    "torch.distributed.rpc",
    "torch.distributed.autograd",
    "torch.distributed.nn.api.remote_module",
    "torch._C._distributed_rpc",
    "torch._C._distributed_autograd",
)


def _is_rpc_object(value: Any) -> bool:
    if isinstance(value, ModuleType):
        return value.__name__.startswith(_RPC_MODULES)
    if not callable(value):  # constants (ints, strings, ...) are not identities
        return False
    module = getattr(value, "__module__", None)
    return isinstance(module, str) and module.startswith(_RPC_MODULES)


class Table:
    """torch's RPC objects (by identity) and what stands in for each."""

    def __init__(self) -> None:
        self._new: dict[int, tuple[Any, Any]] = {}

    def __len__(self) -> int:
        return len(self._new)

    def add(self, old: Any, new: Any) -> None:
        """``old`` (torch's) is replaced by ``new`` (distgrad's) wherever it is bound."""
        if old is not new and old is not None:
            self._new[id(old)] = (old, new)  # keeps old alive, so its id stays its own

    def add_module(self, old: ModuleType, new: ModuleType) -> None:
        """The module and every RPC object it binds under a name ``new`` also has."""
        self.add(old, new)
        for name, value in list(vars(old).items()):
            if name.startswith("__") or not _is_rpc_object(value):
                continue
            try:
                replacement = getattr(new, name)
            except AttributeError:
                continue
            self.add(value, replacement)

    def lookup(self, value: Any) -> Any:
        entry = self._new.get(id(value))
        if entry is not None and entry[0] is value:
            return entry[1]
        return None

    def sweep(self, skip: set[int]) -> int:
        """Rebind in every loaded module but those in ``skip`` (ids) and distgrad's own;
        returns how many names were rebound."""
        rebound = 0
        for module in list(sys.modules.values()):
            if not isinstance(module, ModuleType) or id(module) in skip:
                continue
            name = getattr(module, "__name__", "")
            if not isinstance(name, str) or name == "distgrad" or name.startswith("distgrad."):
                continue
            try:
                namespace = module.__dict__
                items = list(namespace.items())
            except Exception:  # an exotic module object: leave it alone
                continue
            for key, value in items:
                new = self.lookup(value)
                if new is not None:
                    namespace[key] = new
                    rebound += 1
        return rebound
