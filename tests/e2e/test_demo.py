"""``distgrad demo`` as a user runs it: real worker processes, both layouts, bad options, and
Ctrl-C stopping every worker."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(240)

REPO = Path(__file__).resolve().parents[2]


def _demo_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "distgrad", "demo", *args]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), env.get("PYTHONPATH", "")])
    return env


def _run(*args: str, timeout: float = 200) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        _demo_command(*args),
        check=False,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=_env(),
    )


def test_pipeline_demo_trains_and_gradients_match_local_autograd() -> None:
    """One epoch of the pipeline on 3 workers: the start-up is reported before anything else
    (first line at once, then the workers' imports and the group's meeting), the stages are
    described by their layer sizes, the loss and accuracy lines appear, the gradient check
    passes, and the command exits 0."""
    done = _run("--layout", "pipeline", "--epochs", "1", "--workers", "3")
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("distgrad demo: layout 'pipeline', 3 worker processes"), lines
    assert lines[1].startswith("  3/3 workers imported torch and distgrad ("), lines
    assert lines[2].startswith("  3/3 workers joined the RPC group ("), lines
    assert "(worker1: 64 -> 128 -> 96, worker2: 96 -> 64 -> 10)" in done.stdout
    assert "micro-batches in flight at once" in done.stdout
    assert "epoch 1/1  loss" in done.stdout and "test accuracy" in done.stdout
    assert "gradients equal to single-process torch autograd's" in done.stdout, done.stdout


def _results(stdout: str) -> list[str]:
    """The epoch lines without their timings."""
    return [line.rsplit("(", 1)[0] for line in stdout.splitlines() if "  epoch " in line]


def test_parameter_server_demo_is_reproducible_for_a_seed() -> None:
    """Two runs of ``--layout ps`` with the same seed print the same losses and accuracies
    (the trainers take turns in a fixed order), and each passes the gradient check."""
    runs = [_run("--layout", "ps", "--epochs", "2", "--workers", "3") for _ in range(2)]
    for done in runs:
        assert done.returncode == 0, done.stdout + done.stderr
        assert "gradients equal to single-process torch autograd's" in done.stdout, done.stdout
    first, second = (_results(done.stdout) for done in runs)
    assert len(first) == 2 and "loss" in first[0]
    assert first == second


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--workers", "1"), "--workers must be at least 2"),
        (("--layout", "pipeline", "--workers", "9"), "supports at most 5 workers"),
        (("--epochs", "0"), "--epochs must be at least 1"),
        (("--micro-batches", "64", "--batch-size", "8"), "--micro-batches must be between"),
        (("--lr", "-1"), "--lr must be positive"),
        (("--layout", "ring"), "invalid choice: 'ring'"),
    ],
)
def test_bad_options_are_refused_clearly(args: tuple[str, ...], message: str) -> None:
    """Bad options exit with status 2 and a message naming the problem, starting nothing."""
    done = _run(*args, timeout=60)
    assert done.returncode == 2
    assert message in done.stderr


def _children(pid: int) -> set[int]:
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid:
            found.add(int(entry))
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_ctrl_c_stops_every_worker() -> None:
    """SIGINT to the demo while it trains: it exits with 130 and no worker survives."""
    # As from a terminal: a suite run in the background (`cmd &`) ignores SIGINT, which the
    # demo would inherit (and Python then leaves it ignored); a handled signal is reset to its
    # default in the child at exec.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = subprocess.Popen(
            _demo_command("--epochs", "50"),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_env(),
        )
    finally:
        signal.signal(signal.SIGINT, previous)
    workers: set[int] = set()
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # wait until training is under way
            line = proc.stdout.readline()
            workers |= _children(proc.pid)
            if "epoch 1/50" in line:
                break
        else:
            pytest.fail("the demo did not start training in time")
        workers |= _children(proc.pid)
        assert len(workers) >= 3
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 130, err
        assert "interrupted" in err
        time.sleep(0.5)
        assert not [pid for pid in workers if _alive(pid)]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        for pid in workers:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
