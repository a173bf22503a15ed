"""The substitution itself: distgrad's modules under torch's names, the names torch's C
extension gives libraries, the names ``import torch`` bound, and the rebinding sweep.

What each step covers and what it cannot is in docs/libraries.md.
"""

from __future__ import annotations

import logging
import sys
import typing
from types import ModuleType
from typing import Any

import torch
import torch.distributed

from .. import autograd as _autograd
from .. import nn as _nn
from .. import optim as _optim
from .. import rpc as _rpc
from .._rpc import _api as _api_impl
from ..nn.api import remote_module as _remote_module
from ._hooks import after_import, alias, target
from ._rebind import Table

__all__ = ["substitute"]

_log = logging.getLogger("distgrad")

#: torch's module -> distgrad's (the same module object under both names after the switch)
MODULES = {
    "torch.distributed.rpc": "distgrad.rpc",
    "torch.distributed.autograd": "distgrad.autograd",
    "torch.distributed.nn.api.remote_module": "distgrad.nn.api.remote_module",
}
#: every submodule under these torch packages is distgrad's of the same name
PREFIXES = {
    "torch.distributed.rpc.": "distgrad.rpc.",
    "torch.distributed.autograd.": "distgrad.autograd.",
}
#: names of torch's C extension that Python code outside torch's RPC reads
C_RPC_NAMES = (
    "PyRRef",
    "RpcBackendOptions",
    "WorkerInfo",
    "_delete_all_user_and_unforked_owner_rrefs",
    "_get_current_rpc_agent",
    "_is_current_rpc_agent_set",
    "_rref_context_get_debug_info",
    "_set_rpc_timeout",
    "get_rpc_timeout",
)
C_AUTOGRAD_NAMES = (
    "DistAutogradContext",
    "_current_context",
    "_get_debug_info",
    "_get_max_id",
    "_init",
    "_is_valid_context",
    "_new_context",
    "_release_context",
    "_retrieve_context",
    "backward",
    "get_gradients",
)

_done = False


def _check_torch_agent() -> None:
    c_rpc = getattr(torch._C, "_distributed_rpc", None)
    is_set = getattr(c_rpc, "_is_current_rpc_agent_set", None)
    if is_set is not None and getattr(is_set, "__module__", "").startswith("torch") and is_set():
        raise RuntimeError(
            "distgrad.patch_torch(): torch's own RPC agent is running in this process; "
            "patch before init_rpc (or set DISTGRAD_PATCH_TORCH=1 before the process starts)"
        )


def _c_module(name: str, table: Table, names: tuple[str, ...], source: ModuleType) -> None:
    """Point ``torch._C.<name>``'s ``names`` at ``source``'s (making the module where torch
    was built without it)."""
    module = getattr(torch._C, name, None)
    if module is None:
        module = ModuleType(f"torch._C.{name}")
        module.__doc__ = f"distgrad's stand-in for torch's {name} (torch has none here)"
        setattr(torch._C, name, module)
    sys.modules[f"torch._C.{name}"] = module
    for attr in names:
        new = getattr(source, attr)
        table.add(getattr(module, attr, None), new)
        setattr(module, attr, new)


def _modules(table: Table) -> set[int]:
    """distgrad's modules under torch's names; returns the ids of torch's replaced ones."""
    replaced: set[int] = set()
    alias(MODULES, PREFIXES)  # from now on, an import of these names gives distgrad's
    for name in list(sys.modules):
        distgrad_name = target(name)
        if distgrad_name is None:
            continue
        old = sys.modules[name]
        if old is None:  # a failed import's marker: let the alias hook answer next time
            del sys.modules[name]
            continue
        try:
            new = __import__(distgrad_name, fromlist=["_"])
        except ModuleNotFoundError as error:
            if error.name != distgrad_name:
                raise
            new = None
        if old is new:
            continue
        replaced.add(id(old))
        if new is None:  # torch has it, distgrad does not: importing it again fails clearly
            del sys.modules[name]
            continue
        table.add_module(old, new)
        sys.modules[name] = new
    sys.modules["torch.distributed.rpc"] = _rpc
    sys.modules["torch.distributed.autograd"] = _autograd
    torch.distributed.rpc = _rpc  # type: ignore[attr-defined]
    torch.distributed.autograd = _autograd  # type: ignore[attr-defined]
    return replaced


def _fix_nn(module: ModuleType) -> None:
    module.RemoteModule = _nn.RemoteModule  # type: ignore[attr-defined]


def _fix_nn_api(module: ModuleType) -> None:
    sys.modules["torch.distributed.nn.api.remote_module"] = _remote_module
    module.remote_module = _remote_module  # type: ignore[attr-defined]


def _fix_optim(module: ModuleType) -> None:
    module.DistributedOptimizer = _optim.DistributedOptimizer  # type: ignore[attr-defined]


def _is_rref_instance(obj: Any) -> bool:
    return isinstance(obj, _rpc.RRef)


def _is_rref(ann: Any) -> bool:
    if ann is _rpc.RRef:  # torch's message
        raise RuntimeError(
            "Attempted to use RRef without a contained type. Please add a contained type, "
            "e.g. RRef[int]"
        )
    return typing.get_origin(ann) is _rpc.RRef


def _fix_jit_internal(module: ModuleType) -> None:
    """TorchScript's RRef helpers: on a torch without RPC, ``import torch`` skipped them, and
    the patched ``rpc.is_available()`` (True) now lets torch call them."""
    if not hasattr(module, "is_rref"):
        module.RRef = _rpc.RRef  # type: ignore[attr-defined]
        module.PyRRef = _rpc.RRef  # type: ignore[attr-defined]
        module.is_rref = _is_rref  # type: ignore[attr-defined]
        module.is_rref_instance = _is_rref_instance  # type: ignore[attr-defined]


def _fix_jit_annotations(module: ModuleType) -> None:
    if not hasattr(module, "is_rref"):  # the same, for TorchScript's annotation parser
        module.RRef = _rpc.RRef  # type: ignore[attr-defined]
        module.is_rref = _is_rref  # type: ignore[attr-defined]
        module.RRefType = getattr(torch._C, "RRefType", None)  # type: ignore[attr-defined]


def _fix_ddp(module: ModuleType) -> None:
    module.RPC_AVAILABLE = True  # type: ignore[attr-defined]  # DDP unwraps RRef outputs
    module.RRef = _rpc.RRef  # type: ignore[attr-defined]


def _bound_by_import_torch(table: Table) -> None:
    """Names ``import torch`` bound from torch's RPC, or skipped on a torch without RPC
    (the sweep finds the bound ones by identity; these are set by name)."""
    jit_internal = sys.modules.get("torch._jit_internal")
    old = getattr(jit_internal, "is_rref_instance", None)
    if old is not None and not hasattr(jit_internal, "is_rref"):
        table.add(old, _is_rref_instance)  # a module that took the always-False one
    after_import("torch._jit_internal", _fix_jit_internal)
    after_import("torch.jit.annotations", _fix_jit_annotations)
    after_import("torch.nn.parallel.distributed", _fix_ddp)


def substitute() -> None:
    """Make distgrad torch's RPC in this process (idempotent; the caller holds the lock)."""
    global _done
    if _done and sys.modules.get("torch.distributed.rpc") is _rpc:
        return
    if not torch.distributed.is_available():
        raise RuntimeError(
            "distgrad.patch_torch(): this torch was built without torch.distributed "
            "(distgrad needs its stores for the rendezvous)"
        )
    _check_torch_agent()
    table = Table()
    replaced = _modules(table)
    _c_module("_distributed_rpc", table, C_RPC_NAMES, _rpc)
    _c_module("_distributed_autograd", table, C_AUTOGRAD_NAMES, _autograd)
    _bound_by_import_torch(table)
    for name in ("torch.distributed.optim", "torch.distributed.optim.optimizer"):
        # torch's class, where it was imported before the switch (a library's name for it)
        table.add(
            getattr(sys.modules.get(name), "DistributedOptimizer", None),
            _optim.DistributedOptimizer,
        )
    # torch.futures.wait_all / collect_all stop at the first failed distgrad future
    for name, ours in (
        ("wait_all", _api_impl.futures_wait_all),
        ("collect_all", _api_impl.futures_collect_all),
    ):
        if getattr(torch.futures, name) is not ours:
            table.add(getattr(torch.futures, name), ours)
            setattr(torch.futures, name, ours)
    after_import("torch.distributed.nn", _fix_nn)
    after_import("torch.distributed.nn.api", _fix_nn_api)
    after_import("torch.distributed.optim", _fix_optim)
    after_import("torch.distributed.optim.optimizer", _fix_optim)
    rebound = table.sweep(replaced)
    _done = True
    _log.debug("patch_torch: %d objects of torch's RPC, %d names rebound", len(table), rebound)
