"""A context lives on its creator until the creator's ``with dist_autograd.context()`` block
ends, whatever other workers release (issue 23, item 6): on in-memory worlds, a peer dies and
the cleanup its death sets off on the survivors reaches the creator while its block is open."""

from __future__ import annotations

import threading
import time

import torch

import distgrad.autograd as dist_autograd
import distgrad.rpc as rpc
from distgrad._autograd._context import CONTAINER
from distgrad.testing import World, open_world, world_options


def hop(x: torch.Tensor, path: list[int]) -> torch.Tensor:
    """``x * 2`` here, then the same on the next worker of ``path`` (a nested call)."""
    y = x * 2
    if path:
        y = rpc.rpc_sync(f"worker{path[0]}", hop, (y, path[1:]))
    return y


def contexts_here() -> int:
    return CONTAINER.num_contexts()


def _wait_until_released(world: World, rank: int, bound: float) -> None:
    deadline = time.monotonic() + bound
    while world.run_on(rank, contexts_here) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert world.run_on(rank, contexts_here) == 0, f"worker{rank} kept its context"


def test_a_peers_death_never_releases_the_creators_open_context() -> None:
    """0 -> 1 -> 2 -> 3 -> 0 nested: worker1 dies; worker2 (which only worker1 linked to the
    context) releases it and the release spreads to worker3, which tells worker0 -- where the
    context stays until its block ends, and leaving the block raises nothing (before:
    "Could not find autograd context")."""
    forwarded = threading.Event()
    spread = threading.Event()
    outcome: dict[str, object] = {}
    with open_world(4, options=world_options(rpc_timeout=3.0), timeout=20) as world:

        def creator(rank: int) -> None:
            try:
                with dist_autograd.context() as context_id:
                    x = torch.ones(2, requires_grad=True)
                    rpc.rpc_sync("worker1", hop, (x, [2, 3, 0]))
                    forwarded.set()
                    assert spread.wait(15)
                    # a round trip to worker3 carries whatever it had queued for worker0
                    rpc.rpc_sync("worker3", contexts_here)
                    time.sleep(0.3)
                    outcome["inside"] = CONTAINER.has_context(context_id)
            except Exception as exc:
                outcome["error"] = repr(exc)

        thread = threading.Thread(target=world.run, args=(creator,), kwargs={"ranks": [0]})
        thread.start()
        try:
            assert forwarded.wait(15)
            world.kill(1)
            _wait_until_released(world, 3, 10.0)
        finally:
            spread.set()
            thread.join(20)
        assert not thread.is_alive()
        assert world.run_on(0, contexts_here) == 0
    assert outcome == {"inside": True}, outcome
