"""The many-hosts commands of docs/launching.md, run as written on network-namespace "hosts"
(``tests/_netns.py``): torchrun multi-node with c10d rendezvous on two hosts, and a Slurm batch
step (Slurm's per-task variables set as srun sets them) of four tasks on two nodes. Each runs
``examples/train.py``, whose gradient check must pass on worker 0. Skips cleanly where
namespaces cannot be made."""

from __future__ import annotations

import os
import re
import secrets
import socket
import subprocess
import sys

import pytest

from tests._harness import REPO
from tests._needs import command, needs
from tests._netns import Hosts, unavailable

pytestmark = [
    pytest.mark.timeout(240),
    needs(unavailable()),
]

DOCS = REPO / "docs" / "launching.md"
BIN = os.path.dirname(sys.executable)


def documented(marker: str) -> str:
    """The bash block that follows ``<!-- multihost:<marker> -->`` in docs/launching.md."""
    text = DOCS.read_text()
    found = re.search(rf"<!-- multihost:{marker} -->\s*```bash\n(.*?)```", text, re.S)
    assert found, f"docs/launching.md has no multihost:{marker} block"
    return found.group(1)


def _env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("DISTGRAD_", "MASTER_", "SLURM_", "TORCHELASTIC"))
        and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")
    }
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), str(REPO)])
    env["PATH"] = os.pathsep.join([BIN, env.get("PATH", "/usr/bin:/bin")])
    env.update(extra)
    return env


def _finish(procs: list[subprocess.Popen[str]]) -> list[str]:
    outputs = []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
            pytest.fail(f"did not finish:\n{out}")
        outputs.append(out)
    for proc, out in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, out
    return outputs


def _gradient_check_passed(outputs: list[str]) -> None:
    text = "\n".join(outputs)
    found = re.search(r"gradient check: max \|distributed - local\| = (\S+) .*: OK", text)
    assert found, text
    assert "epoch 3/3" in text, text


@needs(command("torchrun", path=BIN))
def test_torchrun_multinode_command_from_the_docs() -> None:
    """The documented torchrun command on two hosts, two workers each (c10d rendezvous)."""
    command = documented("torchrun").strip()
    secret = secrets.token_hex(32)
    with Hosts(2) as hosts:
        for k in range(2):  # as on a cluster: a host's own name resolves to its address
            hosts.hosts_file(k, {socket.gethostname(): hosts.address(k)})
        procs = [
            hosts.popen(
                k,
                ["bash", "-c", f"cd {REPO} && {command}"],
                _env(
                    NNODES="2",
                    NODE_RANK=str(k),
                    HOST0=hosts.address(0),
                    MY_ADDR=hosts.address(k),
                    DISTGRAD_SECRET=secret,
                ),
            )
            for k in range(2)
        ]
        _gradient_check_passed(_finish(procs))


@needs(command("distgrad", path=BIN))
def test_slurm_batch_script_from_the_docs() -> None:
    """The documented srun step, as each of four tasks on two nodes runs it: Slurm's variables
    per task, the node list compressed as Slurm writes it, node names resolving per host."""
    script = documented("slurm")
    step = next(line for line in script.splitlines() if line.startswith("srun "))
    command = step[step.index("distgrad slurm") :]  # what srun starts in every task
    secret = secrets.token_hex(32)
    with Hosts(2) as hosts:
        names = {f"dgnode{k}": hosts.address(k) for k in range(2)}
        for k in range(2):
            hosts.hosts_file(k, names)
        procs = []
        for task in range(4):
            node = task // 2
            env = _env(
                SLURM_JOB_ID="4242",
                SLURM_PROCID=str(task),
                SLURM_NTASKS="4",
                SLURM_LOCALID=str(task % 2),
                SLURM_NODEID=str(node),
                SLURM_JOB_NODELIST="dgnode[0-1]",
                SLURM_TASKS_PER_NODE="2(x2)",
                DISTGRAD_SECRET=secret,
            )
            procs.append(hosts.popen(node, ["bash", "-c", f"cd {REPO} && {command}"], env))
        _gradient_check_passed(_finish(procs))
