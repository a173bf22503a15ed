"""``torch.distributed.nn.api.remote_module``'s path:
``from distgrad.nn.api.remote_module import RemoteModule``, and the private names torch's
RemoteModule tests import from it."""

from __future__ import annotations

from ..._nn._remote_module import RemoteModule

__all__ = ["RemoteModule"]

#: the attributes of a RemoteModule that travel when it is pickled (torch's tuple; distgrad's
#: reducer sends these and the module's ``training`` flag)
_REMOTE_MODULE_PICKLED_ATTRIBUTES = (
    "on",
    "device",
    "is_device_map_set",
    "is_scriptable",
    "generated_methods",
    "module_rref",
)
#: the attributes that do not travel (torch's tuple)
_REMOTE_MODULE_ATTRIBUTES_IGNORE_FOR_PICKLING = (
    "training",
    "_parameters",
    "_buffers",
    "_non_persistent_buffers_set",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_is_full_backward_hook",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
    "_state_dict_pre_hooks",
    "_modules",
    "forward_async",
    "forward",
)
#: torch's base class of ``RemoteModule`` (its tests subclass it); here they are one class
_RemoteModule = RemoteModule
