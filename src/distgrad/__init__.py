"""distgrad: distributed autograd over RPC for PyTorch.

Layers, each using only the ones listed before it (never the other way round, and no import
cycles: function-local and type-only imports count; tests/unit/test_import_graph.py checks)::

    _errors, _config, _omp      the exception tree, constants and environment variables
    _wire                       framing, the tensor-aware pickler, limits  (bytes <-> messages)
    _devices                    device maps, staging and streams of device tensors (beside
                                _wire: uses nothing of distgrad's but torch)
    _transport                  connections, handshake, TLS, heartbeats, the I/O thread,
                                in-memory and fault-injecting transports  (messages <-> peers)
    _rpc._core                  the agent: calls, serving, codec, call table, pools,
                                statistics, the layer protocol            (calls <-> messages)
    _rpc._rrefs                 RRefs, remote(), the owner and fork protocol, notices
                                (a layer over the agent core, as autograd is)
    _rpc._group                 rendezvous, init_rpc and shutdown, dynamic membership,
                                group operations
    _rpc._api                   the public RPC functions
    _autograd                   contexts, send/recv functions, the backward engine
    _optim, _nn, _profiler      DistributedOptimizer, RemoteModule, profiling across workers
    _testing                    in-memory worlds of whole agents (for tests)
    rpc, autograd, optim, nn,   the public, torch-shaped modules (thin re-exports)
    profiler, testing
    _cli, _launcher, _slurm,    ``distgrad demo``, ``distgrad run``
    _demo, __main__
    _patch                      the switch that makes distgrad torch's RPC
                                (``patch_torch``; on the public modules)

The public, torch-shaped modules are :mod:`distgrad.rpc`, :mod:`distgrad.autograd`,
:mod:`distgrad.optim`, :mod:`distgrad.nn`, :mod:`distgrad.profiler` and
:mod:`distgrad.testing`; everything with a leading underscore is private.
"""

from __future__ import annotations

__version__ = "0.1.0.dev0"

# light: importing it imports neither torch nor the RPC (the start-up hook imports it)
from ._patch._api import patch_torch, patched

__all__ = ["__version__", "patch_torch", "patched"]
