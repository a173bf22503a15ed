"""``distgrad.rpc.constants`` (as ``torch.distributed.rpc.constants``)."""

from .._config import (
    DEFAULT_INIT_METHOD,
    DEFAULT_NUM_WORKER_THREADS,
    DEFAULT_RPC_TIMEOUT_SEC,
    DEFAULT_SHUTDOWN_TIMEOUT,
    UNSET_RPC_TIMEOUT,
)

__all__ = [
    "DEFAULT_INIT_METHOD",
    "DEFAULT_NUM_WORKER_THREADS",
    "DEFAULT_RPC_TIMEOUT_SEC",
    "DEFAULT_SHUTDOWN_TIMEOUT",
    "UNSET_RPC_TIMEOUT",
]
