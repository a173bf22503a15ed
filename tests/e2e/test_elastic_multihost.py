"""An elastic group across three "hosts" (network namespaces, ``tests/_netns.py``): it grows
from 2 to 5 members and shrinks back to 2, with distributed autograd steps checked against
local autograd at each size, over TCP and over mutual TLS. Skips cleanly where namespaces
cannot be made (not root, no iproute2)."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests._harness import REPO
from tests._needs import command, needs
from tests._netns import Hosts, unavailable

pytestmark = [
    pytest.mark.timeout(240),
    needs(unavailable()),
]

WORKER = REPO / "tests" / "e2e" / "elastic_multihost_worker.py"
PORT = 29500
#: host of each rank: the leader on host 0, the others spread over the three hosts
HOST_OF = {0: 0, 1: 1, 2: 2, 3: 0, 4: 1}


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DISTGRAD_", "MASTER_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), str(REPO)])
    env["DISTGRAD_SECRET"] = secrets.token_hex(32)
    return env


def _grow_and_shrink(hosts: Hosts, tls: list[str]) -> dict[str, object]:
    master = f"{hosts.address(0)}:{PORT}"
    env = _env()

    def start(rank: int) -> subprocess.Popen[str]:
        argv = [sys.executable, str(WORKER), str(rank), master, *tls]
        return hosts.popen(HOST_OF[rank], argv, env)

    leader = start(0)
    members = [start(1)]
    assert leader.stdout is not None
    lines = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # (pytest-timeout bounds a readline that blocks)
        line = leader.stdout.readline()
        if not line:
            break
        lines.append(line)
        if line.startswith("GROW"):
            members += [start(rank) for rank in (2, 3, 4)]
            break
    out, _ = leader.communicate(timeout=150)
    output = "".join(lines) + out
    assert leader.returncode == 0, output
    for proc in members:
        member_out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, member_out
    line = next(x for x in output.splitlines() if x.startswith("RESULT "))
    result: dict[str, object] = json.loads(line[len("RESULT ") :])
    return result


def _check(hosts: Hosts, result: dict[str, object]) -> None:
    for size in ("diff_2", "diff_5", "diff_back_to_2"):
        assert isinstance(result[size], float) and result[size] < 1e-5, result
    assert result["members"] == ["w0", "w1"]
    assert result["addresses"] == {f"w{r}": hosts.address(HOST_OF[r]) for r in range(5)}


def test_grow_2_to_5_and_back_over_tcp() -> None:
    """2 -> 5 -> 2 members across three hosts over TCP: exact gradients at each size."""
    with Hosts(3) as hosts:
        _check(hosts, _grow_and_shrink(hosts, []))


@needs(command("openssl"))
def test_grow_2_to_5_and_back_over_mutual_tls(tmp_path: Path) -> None:
    """The same over TLS where each side presents and checks a certificate."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    names = ",".join(f"IP:10.213.0.{k}" for k in range(1, 4))
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=distgrad-test", "-addext", f"subjectAltName={names}",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    with Hosts(3) as hosts:
        _check(hosts, _grow_and_shrink(hosts, [str(cert), str(key)]))
