"""Reinforcement learning with observers calling an agent over RPC (REINFORCE).

The shape of PyTorch's "Getting Started with Distributed RPC Framework" tutorial (its RL
part): worker "agent" (rank 0) holds the policy; workers "observer1" ... "observerN" each run
their own copy of a small environment. For every step, an observer asks the agent for an
action (``agent_rref.rpc_sync().select_action(ob_id, state)``) and reports the reward
(``agent_rref.rpc_sync().report_reward(ob_id, reward)``); the agent starts all observers'
episodes at once (``ob_rref.rpc_async().run_episode(...)``), so their calls arrive
concurrently. After each episode the agent takes one REINFORCE step inside a distributed
autograd context and steps a ``DistributedOptimizer`` over RRefs to the policy's parameters.

The environment is self-contained (no gym): a corridor of ``--length`` cells, a random start
and a random goal; the state is the one-hot position followed by the one-hot goal; actions move
left or right; reaching the goal pays 1 and ends the episode, every other step costs 0.02.

The first update's gradients are compared with single-process autograd replaying the same
episode (the recorded states and actions) through a copy of the policy with the same weights;
exit status 1 if they differ.

    python examples/rl_actor_learner.py --observers 2 --episodes 300  # starts its own workers
    distgrad run -n 3 examples/rl_actor_learner.py                    # or: agent + 2 observers
"""

from __future__ import annotations

import argparse
import copy
import os
import random
import sys
import threading
import time

import torch
from _local import spawn_workers  # examples/_local.py: start the workers locally
from torch import nn

import distgrad.autograd as dist_autograd
import distgrad.rpc as rpc
from distgrad.optim import DistributedOptimizer

TOLERANCE = 1e-5
GAMMA = 0.95


class Corridor:
    """A 1-D corridor: walk from a random start to a random goal."""

    def __init__(self, length: int, seed: int) -> None:
        self.length = length
        self.rng = random.Random(seed)
        self.position = self.goal = 0

    def observe(self) -> torch.Tensor:
        state = torch.zeros(2 * self.length)
        state[self.position] = 1.0
        state[self.length + self.goal] = 1.0
        return state

    def reset(self) -> torch.Tensor:
        self.position, self.goal = self.rng.sample(range(self.length), 2)
        return self.observe()

    def step(self, action: int) -> tuple[torch.Tensor, float, bool]:
        move = 1 if action == 1 else -1
        self.position = min(self.length - 1, max(0, self.position + move))
        if self.position == self.goal:
            return self.observe(), 1.0, True
        return self.observe(), -0.02, False


class Policy(nn.Module):
    def __init__(self, length: int, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.net = nn.Sequential(nn.Linear(2 * length, 32), nn.ReLU(), nn.Linear(32, 2))

    def forward(self, state: torch.Tensor) -> torch.Tensor:
        return nn.functional.log_softmax(self.net(state), dim=-1)


def policy_loss(
    log_probs: dict[int, list[torch.Tensor]], rewards: dict[int, list[float]]
) -> torch.Tensor:
    """REINFORCE: -sum(log pi(a|s) * normalised discounted return), returns per observer."""
    all_log_probs, all_returns = [], []
    for ob_id in sorted(log_probs):
        returns, discounted = [], 0.0
        for reward in reversed(rewards[ob_id]):
            discounted = reward + GAMMA * discounted
            returns.insert(0, discounted)
        all_log_probs += log_probs[ob_id]
        all_returns += returns
    returns_t = torch.tensor(all_returns)
    if len(returns_t) > 1:
        returns_t = (returns_t - returns_t.mean()) / (returns_t.std() + 1e-6)
    return -(torch.stack(all_log_probs) * returns_t).sum()


# -- an observer ---------------------------------------------------------------------------------
class Observer:
    def __init__(self, length: int, seed: int) -> None:
        self.id = rpc.get_worker_info().id
        self.env = Corridor(length, seed + self.id)

    def run_episode(self, agent_rref: rpc.RRef[Agent], max_steps: int) -> None:
        state = self.env.reset()
        for _ in range(max_steps):
            action = agent_rref.rpc_sync().select_action(self.id, state)
            state, reward, done = self.env.step(action)
            agent_rref.rpc_sync().report_reward(self.id, reward)
            if done:
                break


# -- the agent -----------------------------------------------------------------------------------
class Agent:
    def __init__(self, observers: list[str], args: argparse.Namespace) -> None:
        self.agent_rref = rpc.RRef(self)
        self.policy = Policy(args.length, args.seed)
        self.optimizer = DistributedOptimizer(
            torch.optim.Adam, [rpc.RRef(p) for p in self.policy.parameters()], lr=args.lr
        )
        self.ob_rrefs = [
            rpc.remote(name, Observer, args=(args.length, args.seed)) for name in observers
        ]
        self.ob_ids = [rpc.get_worker_info(name).id for name in observers]
        self.generator = torch.Generator().manual_seed(args.seed)
        self.lock = threading.Lock()  # observers call select_action concurrently
        self.clear()

    def clear(self) -> None:
        self.states: dict[int, list[torch.Tensor]] = {i: [] for i in self.ob_ids}
        self.actions: dict[int, list[int]] = {i: [] for i in self.ob_ids}
        self.log_probs: dict[int, list[torch.Tensor]] = {i: [] for i in self.ob_ids}
        self.rewards: dict[int, list[float]] = {i: [] for i in self.ob_ids}

    def select_action(self, ob_id: int, state: torch.Tensor) -> int:
        log_probs = self.policy(state)  # on this RPC thread; the graph is kept for the update
        with self.lock:
            action = int(torch.multinomial(log_probs.exp().detach(), 1, generator=self.generator))
        self.states[ob_id].append(state)
        self.actions[ob_id].append(action)
        self.log_probs[ob_id].append(log_probs[action])
        return action

    def report_reward(self, ob_id: int, reward: float) -> None:
        self.rewards[ob_id].append(reward)

    def run_episode(self, max_steps: int) -> None:
        futures = [ob.rpc_async().run_episode(self.agent_rref, max_steps) for ob in self.ob_rrefs]
        torch.futures.wait_all(futures)

    def finish_episode(self, check: bool) -> float | None:
        """One REINFORCE step; with ``check``, first compare its gradients with a
        single-process replay of the episode and return the max |difference|."""
        difference = None
        before = copy.deepcopy(self.policy) if check else None
        with dist_autograd.context() as context_id:
            dist_autograd.backward(context_id, [policy_loss(self.log_probs, self.rewards)])
            if before is not None:
                grads = dist_autograd.get_gradients(context_id)
                difference = self.replay_difference(
                    before, [grads[p] for p in self.policy.parameters()]
                )
            self.optimizer.step(context_id)
        return difference

    def replay_difference(self, policy: Policy, distributed: list[torch.Tensor]) -> float:
        log_probs = {
            i: list(
                policy(torch.stack(self.states[i]))
                .gather(1, torch.tensor(self.actions[i])[:, None])
                .squeeze(1)
            )
            for i in self.ob_ids
        }
        policy_loss(log_probs, self.rewards).backward()
        return max(
            float((d - p.grad).abs().max())
            for d, p in zip(distributed, policy.parameters(), strict=True)
            if p.grad is not None
        )

    def episode_stats(self) -> tuple[float, float]:
        """Mean total reward per observer, and the fraction that reached the goal."""
        totals = [sum(r) for r in self.rewards.values()]
        reached = [bool(r) and r[-1] > 0 for r in self.rewards.values()]
        return sum(totals) / len(totals), sum(reached) / len(reached)


def run_agent(args: argparse.Namespace, observers: list[str]) -> bool:
    agent = Agent(observers, args)
    difference = None
    window: list[tuple[float, float]] = []  # (mean reward, reached) since the last report
    started = time.perf_counter()
    for episode in range(1, args.episodes + 1):
        agent.run_episode(args.max_steps)
        window.append(agent.episode_stats())
        result = agent.finish_episode(check=episode == 1)
        difference = result if result is not None else difference
        agent.clear()
        if episode == 1 or episode % args.log_every == 0 or episode == args.episodes:
            reward = sum(r for r, _ in window) / len(window)
            reached = sum(g for _, g in window) / len(window)
            print(
                f"episode {episode:4d}  mean reward {reward:6.3f}  reached goal {reached:4.0%}"
                f"  (last {len(window)} episodes)",
                flush=True,
            )
            window.clear()
    elapsed = time.perf_counter() - started
    print(f"{args.episodes} episodes in {elapsed:.2f} s")
    assert difference is not None
    ok = difference <= TOLERANCE
    print(
        f"gradient check: max |distributed - local| = {difference:.2e} "
        f"(tolerance {TOLERANCE:g}): {'OK' if ok else 'FAILED'}",
        flush=True,
    )
    return ok


# -- starting the workers ------------------------------------------------------------------------
def worker(rank: int, world_size: int, init_method: str, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    options = rpc.TensorPipeRpcBackendOptions(init_method=init_method)
    name = "agent" if rank == 0 else f"observer{rank}"
    rpc.init_rpc(name, rank=rank, world_size=world_size, rpc_backend_options=options)
    ok = True
    try:
        if rank == 0:
            ok = run_agent(args, [f"observer{r}" for r in range(1, world_size)])
    finally:
        rpc.shutdown()  # observers wait here, serving, until the agent is done
    if not ok:
        sys.exit(1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--observers", type=int, default=2, help="observer processes (default 2)")
    parser.add_argument("--episodes", type=int, default=300, help="episodes (default 300)")
    parser.add_argument(
        "--max-steps", type=int, default=12, help="steps per episode at most (default 12)"
    )
    parser.add_argument("--length", type=int, default=12, help="corridor length (default 12)")
    parser.add_argument("--lr", type=float, default=0.03)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--timeout", type=float, default=300, help="give up after (s)")
    args = parser.parse_args()
    if args.length < 2:
        parser.error("--length must be at least 2")
    if "RANK" in os.environ:  # started by `distgrad run -n N` or torchrun: one worker
        world_size = int(os.environ["WORLD_SIZE"])
        if world_size < 2:
            parser.error("needs at least 2 workers (the agent and an observer)")
        worker(int(os.environ["RANK"]), world_size, "env://", args)
        return 0
    if args.observers < 1:
        parser.error("--observers must be at least 1")
    return spawn_workers(worker, args.observers + 1, args)


if __name__ == "__main__":
    sys.exit(main())
