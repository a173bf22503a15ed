"""``patch_torch()`` and ``patched()`` (re-exported by ``distgrad`` and ``distgrad._patch``).

Importing this costs nothing: torch and the RPC are imported only when the switch is used.
"""

from __future__ import annotations

import _thread
import sys

__all__ = ["patch_torch", "patched"]

_lock = _thread.RLock()
#: a :func:`patch_torch` is running (on the thread holding ``_lock``)
_busy = False


def patch_torch() -> None:
    """Make distgrad *be* torch's RPC in this process (idempotent).

    After it, ``torch.distributed.rpc`` and its submodules (``api``, ``functions``,
    ``constants``, ``backend_registry``, ``options``, ``internal``, ``_testing``),
    ``torch.distributed.autograd``, ``torch.distributed.optim.DistributedOptimizer``,
    ``torch.distributed.nn.RemoteModule`` and ``torch.distributed.nn.api.remote_module`` are
    distgrad's, however they are reached (``import torch.distributed.rpc as rpc``,
    ``from torch.distributed import rpc``, attribute access), also for modules that imported
    them before this call. ``torch._C._distributed_rpc.PyRRef`` is distgrad's ``RRef`` and
    ``torch._C._distributed_rpc._is_current_rpc_agent_set()`` reports distgrad's agent. It
    works where torch was built without RPC (``torch.distributed.rpc.is_available()`` is
    ``False``). Processes started later inherit nothing from this call: set
    ``DISTGRAD_PATCH_TORCH=1`` in their environment (or call this at the top of the script
    they import), see docs/libraries.md.

    Raises:
        RuntimeError: torch's own RPC agent is already running in this process (call it
            before ``init_rpc``).

    Example:
        import distgrad

        distgrad.patch_torch()
        import torch.distributed.rpc as rpc  # distgrad.rpc

        assert distgrad.patched() and rpc.__name__ == "distgrad.rpc"
    """
    global _busy
    with _lock:
        if _busy:
            # Re-entered on this thread: importing the switch imports torch, whose import
            # runs the start-up hook's patch (DISTGRAD_PATCH_TORCH) -- the call under way
            # finishes the patching.
            return
        _busy = True
        try:
            from ._torch import substitute

            substitute()
        finally:
            _busy = False


def patched() -> bool:
    """Whether distgrad stands in for torch's RPC in this process.

    Returns:
        bool: ``True`` once :func:`patch_torch` (or ``DISTGRAD_PATCH_TORCH=1``) has made
        ``torch.distributed.rpc`` distgrad's.
    """
    module = sys.modules.get("torch.distributed.rpc")
    return module is not None and module.__name__ == "distgrad.rpc"
