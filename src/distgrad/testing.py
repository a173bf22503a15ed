"""Testing fault tolerance: fault injection and in-memory worlds (docs/testing-fault-tolerance.md).

* :func:`open_world` starts N RPC workers in this process over an in-memory transport (the
  same pickling, frames and threads as over sockets, no processes): fast tests of code that
  uses ``distgrad.rpc`` / ``distgrad.autograd``. With ``faults=``, messages can be failed,
  delayed, dropped, duplicated or reordered, links severed and workers frozen.
* :class:`Fault` rules choose messages by torch's message type, the function called, the
  sending and receiving worker, and the n-th match; a :class:`FaultPlan` holds them.
* With real processes, ``init_rpc(..., backend=BackendType.FAULTY_TENSORPIPE,
  rpc_backend_options=FaultyTensorPipeRpcBackendOptions(..., faults=[...]))`` (after
  ``import distgrad.rpc._testing``) injects the same faults; :func:`current_fault_plan` is the
  running worker's plan.

Example::

    from distgrad.testing import Fault, open_world

    with open_world(2, faults=[Fault("drop", type="RREF_USER_DELETE", nth=1)]) as world:
        world.run(my_test_body)      # my_test_body(rank), on one thread per worker
        assert world.faults.fired("drop")
"""

from __future__ import annotations

from ._errors import InjectedFailureError
from ._rpc._core import current_agent
from ._testing._world import World, WorldTimeout, open_world, worker_thread, world_options
from ._transport._faulty import AppliedFault, Fault, FaultPlan, FaultyTransport

__all__ = [
    "AppliedFault",
    "Fault",
    "FaultPlan",
    "InjectedFailureError",
    "World",
    "WorldTimeout",
    "current_fault_plan",
    "open_world",
    "worker_thread",
    "world_options",
]


def current_fault_plan() -> FaultPlan:
    """The fault plan of this worker's agent (started with ``FAULTY_TENSORPIPE`` options, or in
    a world opened with ``faults=``); raises if it injects no faults."""
    agent = current_agent()
    if agent is None:
        raise RuntimeError("RPC has not been initialized. Call distgrad.rpc.init_rpc first.")
    transport = agent.transport
    if not isinstance(transport, FaultyTransport):
        raise RuntimeError(
            "this worker injects no faults: start it with FaultyTensorPipeRpcBackendOptions "
            "(backend FAULTY_TENSORPIPE) or in open_world(..., faults=...)"
        )
    return transport.plan


for _name in ("World", "WorldTimeout", "Fault", "FaultPlan", "AppliedFault"):
    globals()[_name].__module__ = __name__
