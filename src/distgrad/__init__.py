"""distgrad: distributed autograd over RPC for PyTorch.

Layers, each using only the ones listed before it (never the other way round)::

    _wire       framing, the tensor-aware pickler, limits         (bytes <-> messages)
    _devices    device maps, staging and streams of device tensors (beside _wire)
    _transport  connections, handshake, TLS, heartbeats, I/O thread (messages <-> peers)
    _rpc        the agent: rendezvous, calls, futures, shutdown   (calls <-> messages)
    autograd    contexts, send/recv functions, backward engine     (later)
    optim, nn   DistributedOptimizer, RemoteModule (on rpc, autograd)

The public, torch-shaped modules are :mod:`distgrad.rpc`, :mod:`distgrad.autograd`,
:mod:`distgrad.optim` and :mod:`distgrad.nn`; everything with a leading underscore is private.
"""

from __future__ import annotations

__version__ = "0.1.0.dev0"

__all__ = ["__version__"]
