"""The runnable programs under ``examples/``, run as a user runs them (a subprocess that
starts its own worker processes), at a small size: each exits 0, its gradient check against
single-process autograd passes, and no process is left behind."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(240)

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
RUN_TIMEOUT_S = 180
CHECK_LINE = re.compile(r"gradient check: max \|distributed - local\| = (\S+) .*: OK")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), env.get("PYTHONPATH", "")])
    env.pop("DISTGRAD_SECRET", None)  # each run makes its own
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)  # the examples start their own workers when these are unset
    return env


def _group_members(pgid: int) -> list[int]:
    """Live processes in process group ``pgid``."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(entry))
    return members


def run_example(*command: str) -> str:
    """Run ``command`` in its own process group; return its output once it exited 0 and its
    whole process group is gone. Whatever happens, the group is killed at the end."""
    proc = subprocess.Popen(
        [sys.executable, *command],
        cwd=REPO,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        try:
            output, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate(timeout=10)
            pytest.fail(f"{command} did not finish in {RUN_TIMEOUT_S} s:\n{output}")
        assert proc.returncode == 0, output
        deadline = time.monotonic() + 10
        while _group_members(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _group_members(proc.pid), f"processes left behind:\n{output}"
        return output
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if proc.poll() is None:
            proc.wait(10)


def assert_gradient_check_passed(output: str) -> None:
    found = CHECK_LINE.search(output)
    assert found, output
    assert float(found.group(1)) <= 1e-5, output


def test_parameter_server() -> None:
    """A parameter server and two trainers taking turns: 5 steps each, gradients checked."""
    output = run_example(str(EXAMPLES / "parameter_server.py"), "--trainers", "2", "--steps", "5")
    assert_gradient_check_passed(output)
    assert "trainer1: loss" in output and "trainer2: loss" in output


def test_pipeline() -> None:
    """A 3-worker pipeline with 4 micro-batches in flight: 5 steps, gradients checked."""
    output = run_example(str(EXAMPLES / "pipeline.py"), "--steps", "5", "--log-every", "5")
    assert_gradient_check_passed(output)
    assert "step    5  loss" in output


def test_pipeline_under_distgrad_run() -> None:
    """The same program started by ``distgrad run -n 3``: every worker comes from the
    launcher's environment, and the check still passes."""
    output = run_example(
        "-m", "distgrad", "run", "-n", "3", str(EXAMPLES / "pipeline.py"), "--steps", "3"
    )
    assert_gradient_check_passed(output)
    assert "[0] step    3  loss" in output


def test_rnn_embedding_with_sparse_gradients() -> None:
    """The embedding table and decoder on another worker, sparse embedding gradients: 5
    steps, gradients of all three parts checked."""
    output = run_example(str(EXAMPLES / "rnn_embedding.py"), "--steps", "5", "--sparse")
    assert_gradient_check_passed(output)
    assert "sparse embedding gradients" in output


def test_rl_actor_learner() -> None:
    """Two observers calling the agent for actions: 3 episodes, the first update checked."""
    output = run_example(
        str(EXAMPLES / "rl_actor_learner.py"), "--observers", "2", "--episodes", "3"
    )
    assert_gradient_check_passed(output)
    assert "episode    3" in output


def test_train_script_as_the_readme_runs_it() -> None:
    """The README's ``distgrad run -n 4 examples/train.py --epochs 3``: four workers from the
    launcher, three epochs on worker 0, the gradient check passes, every worker exits 0."""
    output = run_example(
        "-m", "distgrad", "run", "-n", "4", "examples/train.py", "--epochs", "3", "--steps", "5"
    )
    assert_gradient_check_passed(output)
    assert "[0] epoch 3/3  loss" in output
    assert "hidden block on each of worker1, worker2, worker3" in output


def test_train_script_alone_says_how_to_start_it() -> None:
    """Run without a launcher, ``examples/train.py`` exits 2 naming ``distgrad run``."""
    env = _env()
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "train.py")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert "distgrad run -n 4 examples/train.py" in done.stderr


def test_elastic_parameter_server() -> None:
    """Trainers join a running dynamic group, one leaves, one is killed: the output says who
    joined and left when, the first gradient check passes, and the validation loss falls."""
    output = run_example(str(EXAMPLES / "elastic.py"), "--seconds", "6")
    assert_gradient_check_passed(output)
    for name in ("trainer1", "trainer2", "trainer3"):
        assert re.search(rf"\[\s*[\d.]+s\] {name} \(rank \d\) joined", output), output
    assert re.search(r"\[\s*[\d.]+s\] trainer2 \(rank 2\) left", output), output
    assert "killing trainer3 (SIGKILL)" in output
    assert re.search(r"validation loss [\d.]+( -> [\d.]+){4}: falling", output), output
