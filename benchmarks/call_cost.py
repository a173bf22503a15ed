"""What one RPC costs, counted rather than timed: Python calls, thread wake-ups and syscalls per
``rpc_sync`` no-op, per ``rpc_async`` no-op, per ``rpc_sync`` echo of a 1 KiB tensor (what a
tensor-carrying message adds) and per 2-worker MLP step.

Timings on a shared, loaded host move by tens of per cent between runs; these counts do not
(they depend on the code path, not on the load), so a change to the call path is judged by them
and its speed confirmed by ``rpc_bench.py`` / ``ab_autograd.py`` afterwards.

* **Python calls** (``sys.setprofile`` in every thread): two agents in one process, joined by
  real Unix sockets (``SocketTransport``), each thread counted for the agent it is bound to
  -- caller side (worker0) and callee side (worker1) -- so the counts are those of the
  two-process case, without its noise.
* **Wake-ups and syscalls**: a real 2-process group (``_common.run_group``); per process, the
  voluntary context switches of every thread (``/proc/<pid>/task/*/status``: each is a thread
  that blocked and was woken) and, with ``--strace``, the syscalls of every thread
  (``strace -c`` attached to all of them for the measured window).

Usage (``--src`` picks the tree, e.g. a ``git worktree`` of the base revision)::

    python benchmarks/call_cost.py [--src src] [--calls 2000] [--strace] [--json out.json]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import echo, noop

HIDDEN = 512


# -- Python calls: two agents in this process ----------------------------------------------------
class _Counter:
    """A profile function counting Python calls per agent side while ``on``."""

    def __init__(self) -> None:
        self.on = False
        self.calls: collections.Counter[str] = collections.Counter()
        self.functions: collections.Counter[tuple[str, str]] = collections.Counter()
        self._binding: Any = None
        self._names: dict[int, str] = {}

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        if not self.on or event != "call":
            return
        agent = self._binding.agent
        side = self._names.get(id(agent), "unbound") if agent is not None else "unbound"
        self.calls[side] += 1
        code = frame.f_code
        self.functions[(side, f"{Path(code.co_filename).name}:{code.co_name}")] += 1


def _two_agents(counter: _Counter) -> tuple[Any, Any]:
    import distgrad.autograd
    import distgrad.rpc  # noqa: F401
    from distgrad._rpc._core._agent import RpcAgent, thread_binding
    from distgrad._rpc._core._options import TensorPipeRpcBackendOptions
    from distgrad._rpc._core._worker_info import WorkerInfo
    from distgrad._transport._transport import SocketTransport

    options = TensorPipeRpcBackendOptions(num_worker_threads=4, rpc_timeout=60)
    agents = [
        RpcAgent(f"worker{r}", r, 2, options, transport=SocketTransport, isolated=True)
        for r in (0, 1)
    ]
    counter._binding = thread_binding
    counter._names = {id(agents[0]): "caller", id(agents[1]): "callee"}
    from distgrad._rpc._core._agent import bind_thread

    addresses = {}
    for agent in agents:
        bind_thread(agent)
        addresses[agent.worker_info.id] = agent.start_transport(b"call cost", "127.0.0.1")
    workers = [WorkerInfo(f"worker{r}", r) for r in (0, 1)]
    for agent in agents:
        agent.set_peers(workers, addresses)
    bind_thread(agents[0])
    return agents[0], agents[1]


def python_calls(calls: int, mlp_steps: int, top: int) -> dict[str, Any]:
    import torch

    counter = _Counter()
    threading.setprofile(counter)
    sys.setprofile(counter)
    agent0, agent1 = _two_agents(counter)
    import distgrad.autograd as dist_autograd
    import distgrad.rpc as rpc

    results: dict[str, Any] = {}

    def measure(name: str, n: int, body: Any) -> None:
        body()  # warm (first-use paths: connections, caches)
        for _ in range(50):
            body()
        time.sleep(0.2)
        counter.calls.clear()
        counter.functions.clear()
        counter.on = True
        for _ in range(n):
            body()
        time.sleep(0.3)  # (what the last call left to other threads: its acknowledgements)
        counter.on = False
        results[name] = {
            "per_call": {side: count / n for side, count in sorted(counter.calls.items())},
            "top": [
                (side, fn, round(count / n, 2))
                for (side, fn), count in counter.functions.most_common(top)
            ],
        }

    measure("rpc_sync", calls, lambda: rpc.rpc_sync("worker1", noop))

    def burst() -> None:
        torch.futures.wait_all([rpc.rpc_async("worker1", noop) for _ in range(100)])

    measure("rpc_async", max(1, calls // 100), burst)
    per = results["rpc_async"]["per_call"]
    results["rpc_async"]["per_call"] = {k: v / 100 for k, v in per.items()}
    results["rpc_async"]["top"] = [
        (s, f, round(c / 100, 2)) for s, f, c in results["rpc_async"]["top"]
    ]

    tensor = torch.ones(256)
    measure("echo_1KiB", calls, lambda: rpc.rpc_sync("worker1", echo, (tensor,)))

    torch.manual_seed(0)
    first = torch.nn.Sequential(torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.ReLU())
    head = torch.nn.Linear(HIDDEN, 10)
    x = torch.randn(512, HIDDEN)
    target = torch.randint(0, 10, (512,))
    from autograd_bench import remote_layer

    def step() -> None:
        with dist_autograd.context() as cid:
            h = rpc.rpc_sync("worker1", remote_layer, args=(first(x),))
            loss = torch.nn.functional.cross_entropy(head(h), target)
            dist_autograd.backward(cid, [loss])
            dist_autograd.get_gradients(cid)

    measure("mlp512_step", mlp_steps, step)
    sys.setprofile(None)
    threading.setprofile(None)  # type: ignore[arg-type]
    for agent in (agent0, agent1):
        agent.stop(graceful=False)
    return results


# -- wake-ups and syscalls: a real 2-process group -----------------------------------------------
def _tids() -> list[int]:
    return sorted(int(t) for t in os.listdir("/proc/self/task"))


def _switches(pid: int) -> dict[str, int]:
    """Voluntary context switches per thread name of process ``pid`` (summed)."""
    out: collections.Counter[str] = collections.Counter()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                for line in f:
                    if line.startswith("voluntary_ctxt_switches"):
                        out[_group(name)] += int(line.split()[1])
        except OSError:
            continue
    return dict(out)


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (all its threads)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _group(name: str) -> str:
    for prefix in ("distgrad-worker", "distgrad-callback", "distgrad-io", "distgrad-outbox"):
        if name.startswith(prefix[:15]):
            return prefix
    return name


def _strace(pid: int, out: str) -> subprocess.Popen[bytes]:
    tids = os.listdir(f"/proc/{pid}/task")
    args = ["strace", "-c", "-f", "-o", out]
    for tid in tids:
        args += ["-p", tid]
    return subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _parse_strace(path: str) -> dict[str, int]:
    calls: dict[str, int] = {}
    for line in Path(path).read_text().splitlines():
        parts = line.split()
        if len(parts) >= 5 and parts[0][0].isdigit() and parts[-1] != "total":
            try:
                calls[parts[-1]] = int(parts[3])
            except ValueError:
                continue
    return calls


def wakeups_caller(rpc: Any, dst: str, cfg: dict[str, Any]) -> dict[str, Any]:
    import torch

    me = os.getpid()
    peer = rpc.rpc_sync(dst, os.getpid)
    n = cfg["calls"]
    out: dict[str, Any] = {}
    tensor = torch.ones(256)
    for name in ("rpc_sync", "rpc_async", "echo_1KiB"):

        def body(name: str = name) -> None:
            if name == "rpc_sync":
                for _ in range(n):
                    rpc.rpc_sync(dst, noop)
            elif name == "echo_1KiB":
                for _ in range(n):
                    rpc.rpc_sync(dst, echo, (tensor,))
            else:
                for _ in range(n // 100):
                    torch.futures.wait_all([rpc.rpc_async(dst, noop) for _ in range(100)])

        body()  # warm
        before = (_switches(me), _switches(peer))  # (without strace: its stops are switches too)
        cpu = (_cpu_s(me), _cpu_s(peer))
        started = time.perf_counter()
        body()
        wall = time.perf_counter() - started
        cpu = (_cpu_s(me) - cpu[0], _cpu_s(peer) - cpu[1])
        after = (_switches(me), _switches(peer))
        tracers = []
        files = []
        if cfg["strace"]:
            for pid in (me, peer):
                path = tempfile.mktemp(prefix="strace-", suffix=".txt")
                files.append(path)
                tracers.append(_strace(pid, path))
            time.sleep(2.0)  # attach
            body()
            time.sleep(0.2)
        for tracer in tracers:
            tracer.send_signal(signal.SIGINT)
            tracer.wait(timeout=30)
        result: dict[str, Any] = {
            "wall_us": round(wall / n * 1e6, 1),
            "cpu_us": {"caller": round(cpu[0] / n * 1e6, 1), "callee": round(cpu[1] / n * 1e6, 1)},
        }
        for side, b, a in (("caller", before[0], after[0]), ("callee", before[1], after[1])):
            result[f"{side}_wakeups"] = {
                k: round((a.get(k, 0) - b.get(k, 0)) / n, 2)
                for k in sorted(a)
                if a[k] != b.get(k, 0)
            }
        for side, path in zip(("caller", "callee"), files, strict=False):
            counts = _parse_strace(path)
            result[f"{side}_syscalls"] = {
                k: round(v / n, 2) for k, v in sorted(counts.items()) if v >= n // 20
            }
            os.unlink(path)
        out[name] = result
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--src", default=None, help="the src/ folder to import distgrad from")
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--mlp-steps", type=int, default=50)
    parser.add_argument("--top", type=int, default=25, help="functions listed per measurement")
    parser.add_argument("--strace", action="store_true", help="count syscalls (needs strace)")
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--part", choices=("python", "process"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.part is None:  # run both parts in children importing the chosen tree
        env = dict(os.environ)
        if args.src:
            env["PYTHONPATH"] = str(Path(args.src).resolve())
        report: dict[str, Any] = {"src": args.src or "(importable distgrad)"}
        for part in ("python", "process"):
            cmd = [sys.executable, __file__, "--part", part, "--calls", str(args.calls)]
            cmd += ["--mlp-steps", str(args.mlp_steps), "--top", str(args.top)]
            if args.strace:
                cmd.append("--strace")
            done = subprocess.run(
                cmd, env=env, capture_output=True, text=True, timeout=900, check=False
            )
            if done.returncode != 0:
                print(done.stderr[-3000:], file=sys.stderr)
                return 1
            report[part] = json.loads(done.stdout.strip().splitlines()[-1])
        _print(report)
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=1))
        return 0
    if args.part == "python":
        print(json.dumps(python_calls(args.calls, args.mlp_steps, args.top)))
        return 0
    from _common import run_group

    cfg = {"calls": args.calls, "strace": args.strace}
    result = run_group("distgrad", wakeups_caller, cfg, timeout=600)
    if not result.ok:
        print(result.log_tail, file=sys.stderr)
        return 1
    print(json.dumps(result.value))
    return 0


def _print(report: dict[str, Any]) -> None:
    print(f"distgrad from {report['src']}")
    for name, value in report["python"].items():
        sides = ", ".join(f"{side} {count:.1f}" for side, count in value["per_call"].items())
        print(f"\n{name}: Python calls per call: {sides}")
        for side, fn, count in value["top"]:
            print(f"    {side:7s} {count:7.2f}  {fn}")
    for name, value in report["process"].items():
        print(f"\n{name} (2 processes), per call:")
        for key, counts in value.items():
            print(f"    {key}: {counts}")


if __name__ == "__main__":
    sys.exit(main())
