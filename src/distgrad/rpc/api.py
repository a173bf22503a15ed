"""``distgrad.rpc.api`` (as ``torch.distributed.rpc.api``): the group helpers."""

from .._rpc import _api as _api_impl
from .._rpc import _collectives
from .._rpc._api import (
    get_worker_info,
    init_rpc,
    remote,
    rpc_async,
    rpc_sync,
    shutdown,
)
from .._rpc._rref import RRef

__all__ = ["RRef", "get_worker_info", "init_rpc", "remote", "rpc_async", "rpc_sync", "shutdown"]

#: When False, ``shutdown()`` raises if RRef forks are still registered (leak check).
_ignore_rref_leak = True

_wait_all = _api_impl.wait_all
_all_gather = _collectives.all_gather
_barrier = _collectives.barrier
_wait_all_workers = _collectives.wait_all_workers


def _delete_all_user_and_unforked_owner_rrefs(timeout: float = 60.0) -> None:
    """Tell owners that every UserRRef here is gone and wait for this worker's owned RRefs to
    lose their users (what graceful shutdown does; seconds)."""
    agent = _api_impl._agent()
    agent.rrefs.delete_all_users(timeout)
