"""Keep torch's OpenMP threads from spinning away the CPU that a worker's peers compute on.

On Linux, torch's intra-op parallelism runs on GNU OpenMP (libgomp). After every parallel
region, libgomp keeps the idle threads of the team spinning for ``GOMP_SPINCOUNT`` iterations
(300,000 ``pause`` instructions by default: several milliseconds, often tens) before they
sleep -- unless the process has more OpenMP threads than CPUs, in which case it spins only
1,000 iterations. A distgrad worker whose torch work all runs on one thread (the usual case:
the user's main thread, or one pool thread at a time) has exactly as many OpenMP threads as
CPUs, so whenever it blocks on an RPC -- waiting for a peer that is computing on the same
host -- one of its OpenMP threads spins on a core that peer needs. Measured with 2 workers on
2 cores: half the CPU of the worker waiting in ``dist_autograd.backward``, and steps up to 1.4x
slower (``benchmarks/autograd_bench.py``). torch's own RPC escapes this by accident: its RPC
and autograd threads each own an OpenMP team, which pushes the count over the CPU count.

distgrad does the same on purpose: its I/O thread, which lives as long as the agent, runs one
small parallel region when the agent starts, so its team counts too. That changes nothing
when intra-op threads leave CPUs to spare (the count stays at or under the CPU count), and
nothing at all with ``torch.set_num_threads(1)``, ``OMP_NUM_THREADS=1`` (which ``distgrad run``
sets) or ``OMP_WAIT_POLICY`` given explicitly. ``DISTGRAD_OMP_THROTTLE=0`` turns it off.
"""

from __future__ import annotations

import logging

import torch

from ._config import ENV_OMP_THROTTLE, env_flag

__all__ = ["join_openmp_runtime"]

_log = logging.getLogger("distgrad")

#: More elements than torch's grain size (32,768), so the fill below runs as a parallel region.
_PARALLEL_NUMEL = 1 << 17


def join_openmp_runtime() -> None:
    """Make the calling thread (long-lived: the I/O thread) the master of an OpenMP team."""
    if not env_flag(ENV_OMP_THROTTLE, True) or torch.get_num_threads() < 2:
        return
    try:
        torch.zeros(_PARALLEL_NUMEL)
    except Exception as exc:  # never worth failing a worker for
        _log.debug("could not join the OpenMP runtime: %r", exc)
