"""Profiling across workers: ``import distgrad.profiler``.

RPCs made while torch's profiler is enabled -- ``torch.profiler.profile`` (Kineto),
``torch.autograd.profiler.profile`` or the legacy ``torch.autograd.profiler_legacy.profile``
-- are recorded as ``rpc_{sync|async|remote}#{func}({caller} -> {callee})`` ranges, and what
the callee did for them comes back as ``{key}#remote_op: {name}`` events with the callee's
rank as ``node_id``. :class:`profile` wraps either profiler and writes one Chrome/Perfetto
trace with a track per worker (:meth:`profile.export_chrome_trace`). See docs/profiling.md.

Importing this module (``distgrad.rpc`` does) registers profiling as a layer of the RPC
layer; torch's profiler classes are wrapped only when profiling can first be used (an agent
starts, or a :class:`profile` is made), so importing patches nothing in torch.
"""

from __future__ import annotations

from .._profiler._keys import RPCExecMode, build_rpc_profiling_key
from .._profiler._layer import register as _register
from .._profiler._profile import clock_offsets, export_chrome_trace, profile

__all__ = [
    "RPCExecMode",
    "build_rpc_profiling_key",
    "clock_offsets",
    "export_chrome_trace",
    "profile",
]

#: torch's name (``torch.distributed.rpc.internal._build_rpc_profiling_key``)
_build_rpc_profiling_key = build_rpc_profiling_key

_register()

for _obj in (RPCExecMode, profile):
    _obj.__module__ = __name__
