"""``distgrad.rpc.api`` (as ``torch.distributed.rpc.api``): the group helpers."""

from .._rpc._api import (
    get_worker_info,
    init_rpc,
    rpc_async,
    rpc_sync,
    shutdown,
)
from .._rpc._api import wait_all as _wait_all
from .._rpc._collectives import all_gather as _all_gather
from .._rpc._collectives import barrier as _barrier
from .._rpc._collectives import wait_all_workers as _wait_all_workers

__all__ = ["get_worker_info", "init_rpc", "rpc_async", "rpc_sync", "shutdown"]

_ = (_all_gather, _barrier, _wait_all, _wait_all_workers)
