"""``distgrad.rpc.api`` (as ``torch.distributed.rpc.api``): the group helpers."""

from .._rpc import _api as _api_impl
from .._rpc import _collectives
from .._rpc._api import (
    get_worker_info,
    init_rpc,
    rpc_async,
    rpc_sync,
    shutdown,
)

__all__ = ["get_worker_info", "init_rpc", "rpc_async", "rpc_sync", "shutdown"]

_wait_all = _api_impl.wait_all
_all_gather = _collectives.all_gather
_barrier = _collectives.barrier
_wait_all_workers = _collectives.wait_all_workers
