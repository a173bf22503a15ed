"""The switch that makes distgrad stand in for torch's RPC (docs/libraries.md).

``patch_torch()`` substitutes distgrad's modules for ``torch.distributed.rpc`` (and its
submodules), ``torch.distributed.autograd``, ``DistributedOptimizer`` and ``RemoteModule`` in
this process, and rebinds the names that torch and already-imported libraries took from
torch's RPC. ``DISTGRAD_PATCH_TORCH=1`` does the same in every Python process that inherits
it, through the ``distgrad-patch-torch.pth`` start-up hook (``_startup``).

This package sits above the public modules and the CLI: it imports the public modules, and
nothing below imports it (``distgrad/__init__.py`` re-exports ``_api``'s two functions).
Importing ``_api`` costs nothing: torch and the RPC are imported only when the switch is used.
"""

# like every private package's __init__, this imports nothing: ``_api`` has the functions
