"""The switch that makes distgrad stand in for torch's RPC (docs/libraries.md).

``patch_torch()`` substitutes distgrad's modules for ``torch.distributed.rpc`` (and its
submodules), ``torch.distributed.autograd``, ``DistributedOptimizer`` and ``RemoteModule`` in
this process, and rebinds the names that torch and already-imported libraries took from
torch's RPC. ``DISTGRAD_PATCH_TORCH=1`` does the same in every Python process that inherits
it, through the ``distgrad-patch-torch.pth`` start-up hook (``_startup``).

This package sits at the top of the layers, beside the CLI: it imports the public modules,
and nothing below imports it. Importing it costs nothing: torch and the RPC are imported only
when the switch is used.
"""

from __future__ import annotations

from ._api import patch_torch, patched

__all__ = ["patch_torch", "patched"]
