"""``distgrad run``: the launcher starts N workers with torchrun's environment and a fresh
secret, prefixes their output by rank, and never leaves a worker behind."""

from __future__ import annotations

import hashlib
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

from tests._harness import SRC, free_port

pytestmark = pytest.mark.timeout(120)

#: Bound on one launch of workers that import torch and join an RPC group (2 shared cores).
LAUNCH_S = 60.0
#: Bound on one launch of workers that only run plain Python.
QUICK_S = 20.0

# Each RPC worker makes one call to the next rank and prints what it learnt.
RPC_WORKER = """
import hashlib, os, sys
import torch
import distgrad.rpc as rpc

def whoami():
    return rpc.get_worker_info().name

if MODE == "explicit":
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size)
else:  # what torchrun users write: rank and world size from the environment
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    rpc.init_rpc(f"worker{rank}")
peer = rpc.rpc_sync(f"worker{(rank + 1) % world_size}", whoami)
total = rpc.rpc_sync((rank + 1) % world_size, torch.add, args=(torch.ones(2), rank))
secret = os.environ["DISTGRAD_SECRET"]
print(f"rank={rank} peer={peer} total={total.tolist()} args={sys.argv[1:]}")
print(
    f"env rank={rank} local={os.environ['LOCAL_RANK']}/{os.environ['LOCAL_WORLD_SIZE']} "
    f"master={os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']} "
    f"secret={hashlib.sha256(secret.encode()).hexdigest()} secret_len={len(secret)}"
)
print(f"stderr from {rank}", file=sys.stderr)
rpc.shutdown()
"""


def write(path: Path, source: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(source))
    return path


def rpc_worker(path: Path, mode: str) -> Path:
    return write(path, f"MODE = {mode!r}\n" + RPC_WORKER)


def launcher_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "DISTGRAD_SECRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SRC), env.get("PYTHONPATH")) if p)
    env.update(extra or {})
    return env


def start(
    args: list[str], cwd: Path, env: Mapping[str, str] | None = None
) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "distgrad", "run", *args],
        cwd=cwd,
        env=launcher_env(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(proc: subprocess.Popen[str], timeout: float) -> tuple[int, str, str]:
    """Wait for the launcher (killing it past ``timeout``); return (status, stdout, stderr)."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()  # its workers die with it (PR_SET_PDEATHSIG)
        out, err = proc.communicate()
        pytest.fail(f"the launcher did not finish within {timeout:g}s\n{out}\n{err}")
    return proc.returncode, out, err


def launch(
    args: list[str], cwd: Path, timeout: float, env: Mapping[str, str] | None = None
) -> tuple[int, str, str]:
    return finish(start(args, cwd, env), timeout)


@pytest.fixture
def launched() -> Iterator[list[subprocess.Popen[str]]]:
    """Launchers a test started by hand; killed and reaped at the end whatever happens."""
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=30)


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting for a reaper counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def assert_gone(pids: list[int], within: float = 5.0) -> None:
    deadline = time.monotonic() + within
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [p for p in pids if alive(p)]
    for pid in left:  # do not leave them behind for the next test
        os.kill(pid, signal.SIGKILL)
    assert not left, f"worker processes outlived the launcher: {left}"


def wait_for_files(paths: list[Path], proc: subprocess.Popen[str], timeout: float) -> list[int]:
    """Wait until every worker wrote its pid file; return the pids."""
    deadline = time.monotonic() + timeout
    while not all(p.exists() and p.read_text().strip() for p in paths):
        if proc.poll() is not None or time.monotonic() > deadline:
            out, err = proc.communicate(timeout=30)
            pytest.fail(
                f"workers did not get ready (launcher status {proc.returncode})\n{out}{err}"
            )
        time.sleep(0.05)
    return [int(p.read_text()) for p in paths]


def prefixed_lines(text: str, rank: int) -> list[str]:
    return [
        line[len(f"[{rank}] ") :] for line in text.splitlines() if line.startswith(f"[{rank}] ")
    ]


# -- happy paths ---------------------------------------------------------------------------------
def test_run_sets_torchrun_env_and_prefixes_output(tmp_path: Path) -> None:
    """Three workers rendezvous with env://, call each other, share one fresh 64-hex-digit
    secret, and every output line carries its rank; the launcher exits 0."""
    script = rpc_worker(tmp_path / "worker.py", "explicit")
    status, out, err = launch(["-n", "3", str(script), "--flag", "x y"], tmp_path, LAUNCH_S)
    assert status == 0, out + err
    assert all(re.match(r"\[[0-2]\] ", line) for line in out.splitlines()), out
    secrets_seen = set()
    for rank in range(3):
        lines = prefixed_lines(out, rank)
        nxt = (rank + 1) % 3
        assert f"rank={rank} peer=worker{nxt} total={[1.0 + rank] * 2} args=['--flag', 'x y']" in (
            lines
        ), out
        env_line = next(line for line in lines if line.startswith("env "))
        assert f"local={rank}/3 master=127.0.0.1:" in env_line
        assert "secret_len=64" in env_line
        secrets_seen.add(env_line.split("secret=")[1].split()[0])
        assert f"stderr from {rank}" in prefixed_lines(err, rank), err
    assert len(secrets_seen) == 1, "every worker must get the same secret"


def test_module_form_with_torchrun_style_init(tmp_path: Path) -> None:
    """``-m pkg.mod`` runs a module from the working directory; ``init_rpc(name)`` takes rank
    and world size from the environment; a user's DISTGRAD_SECRET and --master-port are kept."""
    write(tmp_path / "launchpkg" / "__init__.py", "")
    rpc_worker(tmp_path / "launchpkg" / "job.py", "torchrun")
    port = free_port()
    status, out, err = launch(
        ["-n", "2", "--master-port", str(port), "-m", "launchpkg.job", "--x"],
        tmp_path,
        LAUNCH_S,
        env={"DISTGRAD_SECRET": "user-chosen-secret"},
    )
    assert status == 0, out + err
    user_secret = hashlib.sha256(b"user-chosen-secret").hexdigest()
    for rank in range(2):
        lines = prefixed_lines(out, rank)
        assert f"rank={rank} peer=worker{1 - rank} total={[1.0 + rank] * 2} args=['--x']" in lines
        env_line = next(line for line in lines if line.startswith("env "))
        assert f"master=127.0.0.1:{port} secret={user_secret}" in env_line, env_line


def test_lines_are_never_split_or_mixed(tmp_path: Path) -> None:
    """Workers writing lines in small unflushed-then-flushed pieces, at the same time, still
    come out as whole lines each with one prefix; a last line without newline gets one."""
    script = write(
        tmp_path / "chatty.py",
        """
        import os, sys
        rank = os.environ["RANK"]
        for i in range(300):
            for piece in (f"line {i} ", "of rank ", rank, " ", "x" * (i % 50)):
                sys.stdout.write(piece)
                sys.stdout.flush()
            sys.stdout.write(" end\\n")
        sys.stdout.write(f"no newline from {rank}")
        """,
    )
    status, out, err = launch(["-n", "3", str(script)], tmp_path, QUICK_S)
    assert status == 0, err
    pattern = re.compile(r"\[(\d)\] line (\d+) of rank (\d) x* end")
    counts = {r: 0 for r in range(3)}
    for line in out.splitlines():
        if line.startswith(("[0] no newline", "[1] no newline", "[2] no newline")):
            assert line == f"{line[:4]}no newline from {line[1]}"
            continue
        match = pattern.fullmatch(line)
        assert match, f"mixed or split line: {line!r}"
        assert match.group(1) == match.group(3)
        assert line.endswith(("x" * (int(match.group(2)) % 50)) + " end")
        counts[int(match.group(1))] += 1
    assert counts == {0: 300, 1: 300, 2: 300}
    assert out.endswith("\n")


# -- failures and signals ------------------------------------------------------------------------
def test_failing_worker_stops_the_others(tmp_path: Path) -> None:
    """A worker that raises after joining the group makes the launcher stop the others, name
    the failed rank and exit with that worker's exit code."""
    script = write(
        tmp_path / "fail.py",
        """
        import os, pathlib, time
        import distgrad.rpc as rpc
        rank = int(os.environ["RANK"])
        rpc.init_rpc(f"worker{rank}")
        pathlib.Path(f"pid{rank}").write_text(str(os.getpid()))
        if rank == 1:
            while not all(pathlib.Path(f"pid{r}").exists() for r in range(3)):
                time.sleep(0.05)
            raise ValueError("rank one gives up")
        time.sleep(120)
        """,
    )
    started = time.monotonic()
    status, out, err = launch(["-n", "3", str(script)], tmp_path, LAUNCH_S)
    assert status == 1, out + err
    assert "rank 1 exited with code 1; stopping the other workers" in err
    assert "[1] ValueError: rank one gives up" in err
    assert time.monotonic() - started < LAUNCH_S
    assert_gone([int((tmp_path / f"pid{r}").read_text()) for r in range(3)])


def test_worker_killed_by_signal_sets_status(tmp_path: Path) -> None:
    """A worker killed by a signal makes the launcher exit with 128 + that signal."""
    script = write(
        tmp_path / "die.py",
        """
        import os, signal, time
        if os.environ["RANK"] == "0":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)
        """,
    )
    status, _out, err = launch(["-n", "2", str(script)], tmp_path, QUICK_S)
    assert status == 128 + signal.SIGKILL, err
    assert "rank 0 was killed by SIGKILL" in err


def test_sigint_stops_every_worker(tmp_path: Path, launched: list[subprocess.Popen[str]]) -> None:
    """SIGINT to the launcher reaches every worker of an RPC group; all stop and the launcher
    exits 130 promptly."""
    script = write(
        tmp_path / "serve.py",
        """
        import os, pathlib, time
        import distgrad.rpc as rpc
        rank = int(os.environ["RANK"])
        rpc.init_rpc(f"worker{rank}")
        pathlib.Path(f"pid{rank}").write_text(str(os.getpid()))
        time.sleep(120)
        """,
    )
    proc = start(["-n", "2", str(script)], tmp_path)
    launched.append(proc)
    pids = wait_for_files([tmp_path / "pid0", tmp_path / "pid1"], proc, LAUNCH_S)
    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)
    status, _out, err = finish(proc, 15.0)
    assert status == 128 + signal.SIGINT, err
    assert "received SIGINT; forwarding it to the workers" in err
    assert time.monotonic() - sent < 10.0
    assert_gone(pids, within=0.5)


def test_stubborn_workers_are_killed_after_grace(
    tmp_path: Path, launched: list[subprocess.Popen[str]]
) -> None:
    """Workers that ignore SIGTERM are killed once the grace period is over; SIGTERM makes the
    launcher exit 143."""
    script = write(
        tmp_path / "stubborn.py",
        """
        import os, pathlib, signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        pathlib.Path(f"pid{os.environ['RANK']}").write_text(str(os.getpid()))
        time.sleep(120)
        """,
    )
    proc = start(["-n", "2", "--grace-period", "1", str(script)], tmp_path)
    launched.append(proc)
    pids = wait_for_files([tmp_path / "pid0", tmp_path / "pid1"], proc, QUICK_S)
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    status, _out, err = finish(proc, 15.0)
    elapsed = time.monotonic() - sent
    assert status == 128 + signal.SIGTERM, err
    assert "killing ranks [0, 1] (grace period over)" in err
    assert 0.9 < elapsed < 8.0
    assert_gone(pids, within=0.5)


def test_workers_die_with_a_killed_launcher(
    tmp_path: Path, launched: list[subprocess.Popen[str]]
) -> None:
    """Even a launcher killed with SIGKILL (no chance to clean up) leaves no worker running."""
    script = write(
        tmp_path / "orphan.py",
        """
        import os, pathlib, time
        pathlib.Path(f"pid{os.environ['RANK']}").write_text(str(os.getpid()))
        time.sleep(120)
        """,
    )
    proc = start(["-n", "2", str(script)], tmp_path)
    launched.append(proc)
    pids = wait_for_files([tmp_path / "pid0", tmp_path / "pid1"], proc, QUICK_S)
    proc.kill()
    proc.communicate(timeout=10)
    assert_gone(pids)


# -- bad options ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["-n", "0", "x.py"], "-n must be at least 1, got 0"),
        (["-n", "2", "missing.py"], "script not found: missing.py"),
        (["-n", "2", "-m", "no_such_module_xyz.job"], "no module named 'no_such_module_xyz.job'"),
        (["-n", "2"], "missing the script to run"),
        (["-n", "two", "x.py"], "invalid int value: 'two'"),
        (["--master-port", "70000", "x.py"], "--master-port must be in 1..65535"),
    ],
)
def test_bad_options_exit_2(tmp_path: Path, args: list[str], message: str) -> None:
    """Bad options are refused with a clear message and exit status 2, starting no worker."""
    (tmp_path / "x.py").write_text("raise SystemExit('must not run')\n")
    status, out, err = launch(args, tmp_path, QUICK_S)
    assert status == 2, out + err
    assert message in err
    assert "must not run" not in out + err
