"""distgrad's defaults, tuning thresholds and environment variables, in one place.

Not here (docs/design.md, "Layers"): constants that define the wire protocol (frame kinds and
limits in ``_wire._frames``, the handshake's version), constants private to one mechanism,
and torchrun's variables (``MASTER_ADDR``, ``RANK``, ``WORLD_SIZE``), which torch's
``env://`` rendezvous reads.

Timeouts follow torch's convention: seconds as floats, ``-1.0`` means "use the current
default", ``0`` means "no timeout".
"""

from __future__ import annotations

import os

# --- torch.distributed.rpc.constants (same names and values as the reference) -------------
DEFAULT_RPC_TIMEOUT_SEC: float = 60.0
DEFAULT_INIT_METHOD: str = "env://"
DEFAULT_NUM_WORKER_THREADS: int = 16
UNSET_RPC_TIMEOUT: float = -1.0
DEFAULT_SHUTDOWN_TIMEOUT: float = 0

# --- distgrad's own knobs -------------------------------------------------------------------
#: Cluster secret for the connection handshake (its UTF-8 bytes are the key).
ENV_SECRET = "DISTGRAD_SECRET"
#: Address to listen on for TCP connections from other hosts (default: derived, see rendezvous).
ENV_LISTEN_ADDR = "DISTGRAD_LISTEN_ADDR"
#: Set to "0" to keep same-host traffic on TCP instead of Unix-domain sockets.
ENV_UNIX_SOCKETS = "DISTGRAD_UNIX_SOCKETS"
#: Set to "0" to use the standard asyncio loop even when uvloop is installed.
ENV_UVLOOP = "DISTGRAD_UVLOOP"
#: Set to "0" to leave torch's OpenMP spinning as it is (see ``distgrad._omp``).
ENV_OMP_THROTTLE = "DISTGRAD_OMP_THROTTLE"
#: Set to "0" to send every tensor through the socket, never by direct memory read
#: (see ``distgrad._transport._memory``).
ENV_CROSS_MEMORY = "DISTGRAD_CROSS_MEMORY"
#: Set to "0" to send mid-size same-host tensors through the Unix socket, never through the
#: connection's shared-memory ring (see ``distgrad._transport._ring``).
ENV_SHM_RING = "DISTGRAD_SHM_RING"
#: Set to "0" to make a receiver copy each buffer out of the ring (and free its space at once)
#: instead of lending the ring's memory to the received tensor until that tensor dies.
ENV_SHM_RING_LEND = "DISTGRAD_SHM_RING_LEND"
#: Bytes of each same-host connection direction's shared-memory ring (``SHM_RING_SIZE``).
ENV_SHM_RING_SIZE = "DISTGRAD_SHM_RING_SIZE"
#: Tensor buffers from this many bytes go through the ring (``SHM_RING_THRESHOLD``).
ENV_SHM_RING_THRESHOLD = "DISTGRAD_SHM_RING_THRESHOLD"
#: Bytes of rings one process may hold for what it sends (``SHM_RING_BUDGET``).
ENV_SHM_RING_BUDGET = "DISTGRAD_SHM_RING_BUDGET"
#: Set to "0" to stage every CUDA tensor through host memory, also between workers that share
#: a GPU (which otherwise exchange it by CUDA IPC: ``_devices._cuda``).
ENV_CUDA_IPC = "DISTGRAD_CUDA_IPC"
#: Comma-separated allow-lists (``pkg.func``, ``pkg.*``): the functions peers may run on this
#: worker, and the classes their messages may make it unpickle (off when neither is set).
ENV_ALLOWED_CALLS = "DISTGRAD_ALLOWED_CALLS"
ENV_ALLOWED_CLASSES = "DISTGRAD_ALLOWED_CLASSES"
#: ``host:port`` of this worker's metrics endpoint (off when unset; docs/observability.md).
ENV_METRICS_ADDR = "DISTGRAD_METRICS_ADDR"
#: Set to "1" to trace calls across workers (``_rpc._core._tracing``).
ENV_TRACE = "DISTGRAD_TRACE"
#: Set to "1" for fail-stop peers: a lost connection proves the peer dead (no reconnection).
ENV_FAIL_STOP = "DISTGRAD_FAIL_STOP"
#: Set to "1" to make distgrad stand in for torch's RPC in every Python process that inherits
#: it (the ``distgrad-patch-torch.pth`` start-up hook; docs/libraries.md).
ENV_PATCH_TORCH = "DISTGRAD_PATCH_TORCH"

#: Default bound on one message (pickle stream plus all tensor buffers), in bytes.
DEFAULT_MAX_MESSAGE_SIZE: int = 16 * 1024**3
#: Heartbeats are sent on an otherwise idle connection every this many seconds.
DEFAULT_HEARTBEAT_INTERVAL: float = 1.0
#: A peer that has sent nothing (not even a heartbeat) for this long is declared dead.
DEFAULT_PEER_TIMEOUT: float = 4.0
#: A connection must finish its handshake within this many seconds.
DEFAULT_HANDSHAKE_TIMEOUT: float = 10.0

#: Tensor buffers at least this large are received straight into their own storage.
DIRECT_RECV_THRESHOLD: int = 64 * 1024
#: Size of each connection's staging buffer for small frames.
RECV_STAGING_SIZE: int = 256 * 1024
#: Tensor buffers at least this large go to a same-host peer by direct memory read, when the
#: peer can read this process's memory (one copy instead of two through the Unix socket).
#: Below it the socket is as fast or faster: its two copies overlap (sender and receiver on
#: two cores) while the socket buffer (4 MiB) takes the whole message at once (measured echo,
#: reads vs socket: 1 MiB 0.96 vs 0.86 ms, 4 MiB 2.36 vs 2.75 ms, 8 MiB 4.05 vs 4.76 ms).
#: Where the connection has a shared-memory ring, buffers the ring can hold (up to half its
#: size) go through it even past this threshold: one copy and nothing back beats a read.
CROSS_MEMORY_THRESHOLD: int = int(
    os.environ.get("DISTGRAD_CROSS_MEMORY_THRESHOLD", "") or 4 * 1024 * 1024
)
#: Each same-host connection direction has a shared-memory ring of this many bytes (a memfd
#: the sender creates and passes over the Unix socket; its pages are faulted in once, at the
#: first message that uses it); tensor buffers from ``SHM_RING_THRESHOLD`` bytes up to half the
#: ring go through it -- one copy in, none out (the received tensor's storage is lent from the
#: ring until it dies), no system call beyond the frame. See ``distgrad._transport._ring``.
SHM_RING_SIZE: int = int(os.environ.get(ENV_SHM_RING_SIZE, "") or 8 * 1024 * 1024)
SHM_RING_THRESHOLD: int = int(os.environ.get(ENV_SHM_RING_THRESHOLD, "") or 64 * 1024)
#: A process makes rings for its connections while they add up to at most this many bytes (32
#: rings of the default size: a worker with more same-host peers sends to the others through
#: the socket), so that a host full of workers cannot tie up N x (N - 1) rings of memory.
SHM_RING_BUDGET: int = int(os.environ.get(ENV_SHM_RING_BUDGET, "") or 256 * 1024 * 1024)
#: CUDA tensors from this size go by CUDA IPC between workers on one GPU; smaller ones are
#: staged through host memory, which costs less than IPC's fixed cost per tensor (measured on
#: an H100, 11-28: an IPC echo took ~3 ms whatever its size, a staged one 1.2 ms + 0.8 ms/MiB)
CUDA_IPC_THRESHOLD: int = 2 * 1024 * 1024


def env_flag(name: str, default: bool) -> bool:
    """Read a boolean environment variable ("0"/"false"/"no" are false)."""
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    return value.strip().lower() not in ("0", "false", "no", "off")


def env_str(name: str) -> str | None:
    """Read a string environment variable; empty counts as unset."""
    value = os.environ.get(name)
    return value if value else None
