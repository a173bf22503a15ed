"""``@rpc.functions.async_execution`` and ``Future.then``: distgrad vs torch (TensorPipe).

The pattern of pytorch/examples' batch RL agent (``distributed/rpc/batch/reinforce.py``):
observers call the agent with ``rpc_sync(agent, select_action, (observer_id, state))``; the
agent's ``select_action`` is an ``@async_execution`` function that stores the state and
returns ``future_actions.then(lambda f: f.wait()[observer_id].item())``; the call that
completes the batch runs the policy on all states at once and sets ``future_actions``, which
answers every waiting observer. Here the observers are threads of ``worker0`` and the agent
lives on ``worker1``. Measured, per implementation, in one 2-process group:

* **batch RL step**: ``k`` observer threads (k = 1, 4, 16) each make ``steps`` calls; the time
  of one round (every observer got its action for one state) = wall time / steps.
* **async no-op**: ``rpc_sync`` of an ``@async_execution`` function returning a completed
  future (what ``async_execution`` costs over a plain call).
* **then chain**: ``rpc_sync`` of an ``@async_execution`` function returning a completed
  future followed by three ``.then`` callbacks.
* **plain no-op** ``rpc_sync``, for reference (the ratio the async ones are compared with).
* **the example's shape**: an agent (``worker0``) and ``N - 1`` observer *processes*
  (``--world-sizes``), the agent starting each episode with ``ob_rref.rpc_async()
  .run_episode(agent_rref, steps)``, each observer calling ``select_action_batch(agent_rref,
  id, state)`` every step with the agent's RRef, the agent sampling from ``Categorical`` and
  taking a REINFORCE step per episode (a stand-in environment instead of gym's CartPole);
  time per step of an episode.

Groups run in rounds in ABBA order (torch, distgrad | distgrad, torch | ...); figures are
medians over the samples of all rounds, and a second table gives each round's ratio.

Usage::

    python benchmarks/async_bench.py [--rounds 3] [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import functools
import gc
import shutil
import sys
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (
    IMPLEMENTATIONS,
    ensure_distgrad_importable,
    environment_info,
    median,
    noop,
    print_table,
    run_group,
    snapshot_package,
    write_json,
)

STATE_SIZE, ACTIONS = 4, 2


# -- the agent (worker1) ------------------------------------------------------------------------
class Agent:
    """The batching agent of the batch RL example: one policy step for ``k`` observers."""

    def __init__(self, k: int) -> None:
        import torch

        torch.manual_seed(0)
        self.policy = torch.nn.Sequential(
            torch.nn.Linear(STATE_SIZE, 32), torch.nn.ReLU(), torch.nn.Linear(32, ACTIONS)
        )
        self.k = k
        self.states = torch.zeros(k, STATE_SIZE)
        self.pending = k
        self.future_actions: Any = torch.futures.Future()
        self.lock = threading.Lock()


_AGENTS: dict[int, Agent] = {}
_AGENTS_LOCK = threading.Lock()


def _agent(k: int) -> Agent:
    with _AGENTS_LOCK:
        agent = _AGENTS.get(k)
        if agent is None:
            agent = _AGENTS[k] = Agent(k)
        return agent


def async_execution(fn: Any) -> Any:
    """What ``torch.distributed.rpc.functions.async_execution`` and distgrad's both do, line
    for line: both callees recognise the ``_wrapped_async_rpc_function`` attribute. Defined
    here so the module-level names (which the callee looks up: functions travel by
    reference) are decorated without importing either implementation at import time."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    wrapper._wrapped_async_rpc_function = fn  # type: ignore[attr-defined]
    return wrapper


@async_execution
def select_action(k: int, observer_id: int, state: Any) -> Any:
    """The agent's ``select_action`` (worker1): store the state; the call completing the
    batch runs the policy for all ``k`` observers and answers them all."""

    return _select(_agent(k), observer_id, state)


def _select(agent: Agent, observer_id: int, state: Any) -> Any:
    import torch

    agent.states[observer_id].copy_(state)
    future_action = agent.future_actions.then(
        lambda future_actions: future_actions.wait()[observer_id].item()
    )
    with agent.lock:
        agent.pending -= 1
        if agent.pending == 0:
            agent.pending = agent.k
            with torch.no_grad():
                actions = agent.policy(agent.states).argmax(dim=1)
            future_actions = agent.future_actions
            agent.future_actions = torch.futures.Future()
            future_actions.set_result(actions)
    return future_action


def make_agent(k: int) -> Agent:
    """The agent object an RRef points at (the example's ``RRef(Agent(...))``)."""
    return Agent(k)


@async_execution
def select_action_rref(agent_rref: Any, observer_id: int, state: Any) -> Any:
    """The example's exact signature: the agent travels as an RRef in every call (each call
    forks it to its owner) and is reached with ``local_value()``."""
    agent: Agent = agent_rref.local_value()
    return _select(agent, observer_id, state)


@async_execution
def async_noop() -> Any:
    import torch

    future: Any = torch.futures.Future()
    future.set_result(None)
    return future


def _plus_one(future: Any) -> int:
    return int(future.wait()) + 1


@async_execution
def then_chain() -> Any:
    import torch

    future: Any = torch.futures.Future()
    future.set_result(0)
    return future.then(_plus_one).then(_plus_one).then(_plus_one)


# -- measurements (worker0) ---------------------------------------------------------------------
def _latency(call: Any, iters: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        call()
    gc.collect()
    clock = time.perf_counter_ns
    samples = []
    for _ in range(iters):
        t0 = clock()
        call()
        samples.append((clock() - t0) / 1e3)
    return samples


def _batch_rounds(
    rpc: ModuleType, dst: str, k: int, steps: int, target: Any, agent: Any = None
) -> float:
    """``k`` observer threads, ``steps`` calls each; µs per round (all k answered). With
    ``agent`` (an RRef), each call passes it instead of ``k``."""
    import torch

    states = [
        torch.randn(steps, STATE_SIZE, generator=torch.Generator().manual_seed(i)) for i in range(k)
    ]
    start = threading.Barrier(k + 1)
    errors: list[BaseException] = []

    def observer(i: int) -> None:
        try:
            start.wait()
            for step in range(steps):
                first = k if agent is None else agent
                action = rpc.rpc_sync(dst, target, args=(first, i, states[i][step]))
                assert action in (0, 1), action
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=observer, args=(i,)) for i in range(k)]
    for thread in threads:
        thread.start()
    start.wait()
    t0 = time.perf_counter_ns()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter_ns() - t0
    if errors:
        raise errors[0]
    return elapsed / 1e3 / steps


def caller(rpc: ModuleType, dst: str, cfg: dict[str, Any]) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    iters, warmup = cfg["iters"], cfg["warmup"]
    out["plain"] = _latency(lambda: rpc.rpc_sync(dst, noop), iters, warmup)
    out["async_noop"] = _latency(lambda: rpc.rpc_sync(dst, async_noop), iters, warmup)
    out["then"] = _latency(lambda: rpc.rpc_sync(dst, then_chain), iters, warmup)
    for k in cfg["observers"]:
        _batch_rounds(rpc, dst, k, cfg["warmup"], select_action)
        out[f"batch{k}"] = [
            _batch_rounds(rpc, dst, k, cfg["steps"], select_action)
            for _ in range(cfg["batch_reps"])
        ]
        agent = rpc.remote(dst, make_agent, (k,))
        _batch_rounds(rpc, dst, k, cfg["warmup"], select_action_rref, agent)
        out[f"rref{k}"] = [
            _batch_rounds(rpc, dst, k, cfg["steps"], select_action_rref, agent)
            for _ in range(cfg["batch_reps"])
        ]
        del agent
    return out


# -- the example's shape: an agent (worker0) and observer processes -----------------------------
def _rpc_module() -> ModuleType:
    """The RPC implementation this worker runs (distgrad imports torch's module too)."""
    return sys.modules.get("distgrad.rpc") or sys.modules["torch.distributed.rpc"]


class ExampleAgent(Agent):
    """The example's ``Agent``: an RRef to itself that observers send back with every call,
    a policy with dropout sampled through ``Categorical``, log-probabilities kept for the
    episode's REINFORCE update."""

    def __init__(self, k: int) -> None:
        import torch

        super().__init__(k)
        self.policy = torch.nn.Sequential(
            torch.nn.Linear(STATE_SIZE, 128),
            torch.nn.Dropout(p=0.6),
            torch.nn.ReLU(),
            torch.nn.Linear(128, ACTIONS),
            torch.nn.Softmax(dim=-1),
        )
        self.optimizer = torch.optim.Adam(self.policy.parameters(), lr=1e-2)
        self.saved_log_probs: list[Any] = []
        self.rref = _rpc_module().RRef(self)

    def finish_episode(self, rewards: Any) -> None:
        import torch

        probs = torch.stack(self.saved_log_probs)
        (-probs * rewards[: len(probs)]).sum().backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.saved_log_probs = []


@async_execution
def select_action_example(agent_rref: Any, observer_id: int, state: Any) -> Any:
    """``Agent.select_action_batch`` of the example, line for line (CPU instead of CUDA)."""
    import torch

    self: ExampleAgent = agent_rref.local_value()
    self.states[observer_id].copy_(state)
    future_action = self.future_actions.then(
        lambda future_actions: future_actions.wait()[observer_id].item()
    )
    with self.lock:
        self.pending -= 1
        if self.pending == 0:
            self.pending = self.k
            probs = self.policy(self.states.clone())  # the example: self.states.cuda()
            m = torch.distributions.Categorical(probs)
            actions = m.sample()
            self.saved_log_probs.append(m.log_prob(actions))
            future_actions = self.future_actions
            self.future_actions = torch.futures.Future()
            future_actions.set_result(actions)
    return future_action


class Observer:
    """An observer process with a stand-in environment (random states)."""

    def __init__(self, observer_id: int) -> None:
        import torch

        self.id = observer_id
        self.gen = torch.Generator().manual_seed(observer_id)

    def run_episode(self, agent_rref: Any, n_steps: int) -> Any:
        import torch

        rpc = _rpc_module()
        rewards = torch.zeros(n_steps)
        state = torch.rand(STATE_SIZE, generator=self.gen)
        for step in range(n_steps):
            action = rpc.rpc_sync(
                agent_rref.owner(), select_action_example, args=(agent_rref, self.id, state)
            )
            state = torch.rand(STATE_SIZE, generator=self.gen) + action
            rewards[step] = 1.0
        return rewards


def example_caller(rpc: ModuleType, dst: str, cfg: dict[str, Any]) -> dict[str, list[float]]:
    """On worker0, the agent: episodes of ``steps`` steps on every observer; µs per step."""
    import torch

    n = cfg["world_size"] - 1
    agent = ExampleAgent(n)
    observers = [rpc.remote(f"worker{r}", Observer, (r - 1,)) for r in range(1, n + 1)]
    times = []
    for episode in range(cfg["episodes"] + 1):  # the first one warms up
        t0 = time.perf_counter_ns()
        futures = [ob.rpc_async().run_episode(agent.rref, cfg["steps"]) for ob in observers]
        rewards = torch.stack(torch.futures.wait_all(futures)).t()
        agent.finish_episode(rewards)
        if episode:
            times.append((time.perf_counter_ns() - t0) / 1e3 / cfg["steps"])
    return {f"example{cfg['world_size']}": times}


LABELS = {
    "plain": "rpc_sync no-op (plain function), µs",
    "async_noop": "rpc_sync of an async_execution no-op, µs",
    "then": "async_execution + 3 then() callbacks, µs",
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="few iterations (smoke run)")
    parser.add_argument("--observers", default="1,4,16", help="k values (default 1,4,16)")
    parser.add_argument(
        "--world-sizes",
        default="3,5",
        help="groups for the example's shape: an agent and N-1 observer processes "
        "(default 3,5; empty: skip)",
    )
    parser.add_argument("--json", help="write the samples and summary here")
    parser.add_argument(
        "--no-snapshot", action="store_true", help="import distgrad from the source tree"
    )
    args = parser.parse_args(argv)
    cfg = {
        "observers": [int(k) for k in args.observers.split(",")],
        "iters": 500 if args.quick else 3000,
        "warmup": 50 if args.quick else 300,
        "steps": 50 if args.quick else 200,
        "batch_reps": 3 if args.quick else 7,
        "world_sizes": [int(n) for n in args.world_sizes.split(",") if n],
        "episodes": 2 if args.quick else 5,
        "example_steps": 50 if args.quick else 200,
    }
    ensure_distgrad_importable()
    snapshot = None if args.no_snapshot else snapshot_package()
    try:
        return _run(args, cfg)
    finally:
        if snapshot is not None:
            shutil.rmtree(snapshot, ignore_errors=True)


def _run(args: argparse.Namespace, cfg: dict[str, Any]) -> int:
    env = environment_info()
    print("distgrad async_execution benchmark -- " + ", ".join(f"{k}={v}" for k, v in env.items()))
    samples: dict[str, dict[str, list[float]]] = {impl: {} for impl in IMPLEMENTATIONS}
    rounds: dict[str, dict[str, list[float]]] = {impl: {} for impl in IMPLEMENTATIONS}
    for round_no in range(1 if args.quick else args.rounds):
        order = IMPLEMENTATIONS if round_no % 2 == 0 else IMPLEMENTATIONS[::-1]  # ABBA
        for impl in order:
            result = run_group(impl, caller, cfg, timeout=600)
            if not result.ok:
                print(f"round {round_no}: {impl} failed in {result.phase}: {result.error}")
                print(result.log_tail)
                return 1
            for key, values in result.value.items():
                samples[impl].setdefault(key, []).extend(values)
                rounds[impl].setdefault(key, []).append(median(values))
            for world_size in cfg["world_sizes"]:
                example = {
                    "world_size": world_size,
                    "episodes": cfg["episodes"],
                    "steps": cfg["example_steps"],
                }
                result = run_group(impl, example_caller, example, 600, world_size=world_size)
                if not result.ok:
                    print(f"round {round_no}: {impl} example failed: {result.error}")
                    print(result.log_tail)
                    return 1
                for key, values in result.value.items():
                    samples[impl].setdefault(key, []).extend(values)
                    rounds[impl].setdefault(key, []).append(median(values))
    labels = dict(LABELS)
    for n in cfg["world_sizes"]:
        labels[f"example{n}"] = f"batch RL example, agent + {n - 1} observer processes, µs/step"
    for k in cfg["observers"]:
        labels[f"batch{k}"] = f"batch RL, {k} observer(s): one round, µs"
        labels[f"rref{k}"] = "  the same, agent passed as an RRef, µs"
    rows, spread = [], []
    summary: dict[str, Any] = {}
    for key, label in labels.items():
        t, d = median(samples["torch"][key]), median(samples["distgrad"][key])
        ratios = [a / b for a, b in zip(rounds["distgrad"][key], rounds["torch"][key], strict=True)]
        summary[key] = {"torch_us": t, "distgrad_us": d, "ratio": d / t, "round_ratios": ratios}
        rows.append([label, f"{t:.1f}", f"{d:.1f}", f"{d / t:.2f}x"])
        spread.append([label, " / ".join(f"{r:.2f}x" for r in ratios), f"{median(ratios):.2f}x"])
    print()
    print_table(["median (lower is better)", "torch", "distgrad", "ratio"], rows)
    print()
    print_table(["per-round ratio", "rounds", "median"], spread)
    if args.json:
        write_json(args.json, {"env": env, "config": cfg, "summary": summary, "samples": samples})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
