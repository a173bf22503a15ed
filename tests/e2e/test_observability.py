"""Issue 30 end to end: a 3-worker job over real sockets with its metrics endpoints on; one
member frozen (SIGSTOP) while every member is scraped; the figures checked against what the
job did (calls made, errors raised, bytes sent); ``distgrad top`` in a real terminal (tmux:
start, read the screen, check a member's row, quit) and ``--once --json``."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from typing import Any

import torch
from prometheus_client import parser  # (the test extra has it)

import distgrad.rpc as rpc
from tests._harness import run_workers, stop_process
from tests._needs import command, needs

CALLS = 20
FAILS = 3
SIZE = 1000  # float32 elements: 4000 bytes each way per call


def double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def fail() -> None:
    raise ValueError("expected failure")


def pid() -> int:
    return os.getpid()


def _top(args: list[str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "distgrad", "top", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def scraped_job(rank: int, world_size: int) -> dict[str, Any]:
    from distgrad._observe import _top as top

    result: dict[str, Any] = {}
    if rank == 0:
        tensor = torch.ones(SIZE)
        for _ in range(CALLS):
            rpc.rpc_sync("worker1", double, (tensor,))
        for _ in range(FAILS):
            try:
                rpc.rpc_sync("worker1", fail)
            except ValueError:
                pass
        addresses = {
            f"worker{r}": rpc.rpc_sync(f"worker{r}", rpc.metrics_address) for r in range(3)
        }
        # top attached before the freeze: worker0's endpoint knows every member's address
        result["members"] = top.discover(
            top._Client(None, 5.0, False, None), [addresses["worker0"]]
        )
        frozen = rpc.rpc_sync("worker2", pid)
        stop_process(frozen)  # (every thread stopped: none serves the call below)
        try:
            try:
                rpc.rpc_sync("worker2", double, (tensor,), timeout=0.5)
            except RuntimeError as exc:  # (a timeout: the member is frozen)
                result["frozen_call"] = type(exc).__name__
            client = top._Client(None, 1.0, False, None)
            started = time.monotonic()
            result["while_frozen"] = top.fetch(client, addresses)
            result["scrape_s"] = time.monotonic() - started
            once = _top(["--once", "--json", "--timeout", "1", addresses["worker0"]])
            result["top_once"] = (once.returncode, once.stdout, once.stderr[-2000:])
        finally:
            os.kill(frozen, signal.SIGCONT)
        texts = {}
        for name, address in addresses.items():
            deadline = time.monotonic() + 20
            while True:
                try:
                    texts[name] = top._Client(None, 5.0, False, None).get(address, "/json")
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.2)
        import urllib.request

        result["prometheus"] = {
            name: urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
            for name, address in addresses.items()
        }
        result["json"] = texts
        result["addresses"] = addresses
    rpc.api._barrier([f"worker{r}" for r in range(world_size)])
    return result


OPTIONS = {"metrics_addr": "127.0.0.1:0", "rpc_timeout": 20}


def _samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    found = {}
    for family in parser.text_string_to_metric_families(text):
        for sample in family.samples:
            found[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return found


def test_three_workers_scraped_with_a_frozen_member() -> None:
    results = run_workers(scraped_job, 3, timeout=120, options=OPTIONS)
    out = results[0]
    assert out["members"] == out["addresses"]
    assert out["frozen_call"] in ("RpcTimeoutError", "RuntimeError", "TimeoutError")
    # while frozen: the frozen member's scrape says so, within the client's bound; the others
    # answer
    frozen = out["while_frozen"]
    assert "error" in frozen["worker2"] and "no answer within" in frozen["worker2"]["error"]
    assert "error" not in frozen["worker0"] and "error" not in frozen["worker1"]
    code, stdout, stderr = out["top_once"]
    assert code == 0, stderr
    view = json.loads(stdout)["members"]
    assert sorted(view) == ["worker0", "worker1", "worker2"]
    assert view["worker1"]["ok"] and view["worker1"]["state"] == "running"
    assert not view["worker2"]["ok"] and "no answer" in view["worker2"]["error"]
    # figures against what the job did
    w0 = _samples(out["prometheus"]["worker0"])
    w1 = _samples(out["prometheus"]["worker1"])
    double_fn, fail_fn = f"{__name__}.double", f"{__name__}.fail"
    to1 = {"worker": "worker0", "peer": "worker1"}
    assert (
        w0[
            (
                "distgrad_calls_total",
                frozenset({**to1, "function": double_fn, "outcome": "ok"}.items()),
            )
        ]
        == CALLS
    )
    assert (
        w0[
            (
                "distgrad_calls_total",
                frozenset({**to1, "function": fail_fn, "outcome": "remote"}.items()),
            )
        ]
        == FAILS
    )
    to2 = {"worker": "worker0", "peer": "worker2", "function": double_fn, "outcome": "timeout"}
    assert w0[("distgrad_calls_total", frozenset(to2.items()))] == 1
    from1 = {"worker": "worker1", "peer": "worker0"}
    assert w1[("distgrad_requests_failed_total", frozenset(from1.items()))] == FAILS
    assert w1[("distgrad_requests_served_total", frozenset(from1.items()))] >= CALLS + FAILS
    sent = w0[("distgrad_sent_bytes_total", frozenset(to1.items()))]
    received = w1[("distgrad_received_bytes_total", frozenset(from1.items()))]
    assert sent == received and sent >= CALLS * SIZE * 4
    back = w1[("distgrad_sent_bytes_total", frozenset(from1.items()))]
    assert back == w0[("distgrad_received_bytes_total", frozenset(to1.items()))]
    assert back >= CALLS * SIZE * 4
    # worker2 was answered late (frozen): its late reply is counted there, and it is up again
    w2 = out["json"]["worker2"]
    assert w2["state"] == "running" and w2["peers"]["worker0"]["requests_served"] >= 2


# -- distgrad top in a real terminal ---------------------------------------------------------
def top_in_tmux(rank: int, world_size: int, session: str) -> dict[str, Any]:
    result: dict[str, Any] = {}
    stop_at = time.monotonic() + 60
    if rank == 0:
        address = rpc.metrics_address()
        assert address is not None
        for _ in range(50):
            rpc.rpc_sync("worker1", double, (torch.ones(10),))
        for _ in range(2):
            try:
                rpc.rpc_sync("worker2", fail)
            except ValueError:
                pass
        import distgrad.autograd as dist_autograd

        x = torch.ones(1000, requires_grad=True)
        for _ in range(3):
            with dist_autograd.context() as cid:
                dist_autograd.backward(cid, [rpc.rpc_sync("worker2", double, (x,)).sum()])
        tmux = ["tmux", "-L", session]
        env = f"PYTHONPATH={shlex.quote(os.environ.get('PYTHONPATH', ''))}"
        line = f"env {env} {shlex.quote(sys.executable)} -m distgrad top {address}; sleep 30"
        subprocess.run(
            [*tmux, "new-session", "-d", "-s", "top", "-x", "150", "-y", "30", line], check=True
        )
        try:
            screen = ""
            while time.monotonic() < stop_at:
                rpc.rpc_sync("worker1", double, (torch.ones(10),))  # traffic while it watches
                screen = subprocess.run(
                    [*tmux, "capture-pane", "-p", "-t", "top"],
                    capture_output=True,
                    text=True,
                    check=False,
                ).stdout
                if "worker1 " in screen and "worker0 -> worker1" in screen:
                    break
                time.sleep(0.2)
            result["screen"] = screen
            subprocess.run([*tmux, "send-keys", "-t", "top", "q"], check=True)
            time.sleep(1.5)
            result["after_q"] = subprocess.run(
                [*tmux, "capture-pane", "-p", "-t", "top"],
                capture_output=True,
                text=True,
                check=False,
            ).stdout
            pids = subprocess.run(
                [*tmux, "list-panes", "-t", "top", "-F", "#{pane_current_command}"],
                capture_output=True,
                text=True,
                check=False,
            ).stdout
            result["pane_command"] = pids.strip()
        finally:
            subprocess.run([*tmux, "kill-server"], capture_output=True, check=False)
    rpc.api._barrier([f"worker{r}" for r in range(world_size)])
    return result


@needs(command("tmux"))
def test_top_in_a_real_terminal() -> None:
    session = f"distgrad-top-{os.getpid()}"
    results = run_workers(top_in_tmux, 3, timeout=120, options=OPTIONS, kwargs={"session": session})
    screen = results[0]["screen"]
    print(screen)
    rows: dict[str, list[str]] = {}
    for line in screen.splitlines():
        words = line.split()
        if len(words) > 2 and words[0].startswith("worker") and words[1] != "->":
            rows[words[0]] = words
    assert rows["worker1"][1] == "running", screen
    assert rows["worker0"][1] == "running" and rows["worker2"][1] == "running", screen
    assert "worker0 -> worker1" in screen, screen
    # q quit top: the pane runs the sleep after it, not python
    assert results[0]["pane_command"] == "sleep", results[0]
