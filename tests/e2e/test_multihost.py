"""Workers on three "hosts" (network namespaces joined by a bridge, ``tests/_netns.py``): a
distributed autograd chain with a stage on each host, over TCP and over mutual TLS, matches
one-process autograd, and each worker listens on its own host's address. Skips cleanly where
namespaces cannot be made (not root, no iproute2)."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

from tests._harness import REPO
from tests._needs import command, needs
from tests._netns import Hosts, unavailable

pytestmark = [
    pytest.mark.timeout(180),
    needs(unavailable()),
]

WORKER = REPO / "tests" / "e2e" / "multihost_worker.py"
PORT = 29500


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DISTGRAD_", "MASTER_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), str(REPO)])
    env["DISTGRAD_SECRET"] = secrets.token_hex(32)
    return env


def _run_group(hosts: Hosts, extra: list[str], master_host: str | None = None) -> dict[str, object]:
    master = f"{master_host or hosts.address(0)}:{PORT}"
    env = _env()
    procs = [
        hosts.popen(k, [sys.executable, str(WORKER), str(k), "3", master, *extra], env)
        for k in range(3)
    ]
    outputs = []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
            pytest.fail(f"a worker did not finish:\n{out}")
        outputs.append(out)
        assert proc.returncode == 0, out
    line = next(x for x in outputs[0].splitlines() if x.startswith("RESULT "))
    result: dict[str, object] = json.loads(line[len("RESULT ") :])
    return result


def _check(hosts: Hosts, result: dict[str, object]) -> None:
    assert isinstance(result["max_difference"], float) and result["max_difference"] < 1e-5
    assert result["rref"] == [2.0, 2.0]
    assert result["addresses"] == [hosts.address(k) for k in range(3)]


def test_three_hosts_over_tcp() -> None:
    """A chain across three hosts over TCP: exact gradients, RRefs, per-host listen addresses."""
    with Hosts(3) as hosts:
        _check(hosts, _run_group(hosts, []))


def test_master_named_by_a_hostname_that_is_loopback_on_its_own_host() -> None:
    """The rendezvous host is a name that host 0 resolves to 127.0.1.1 (Debian's entry for a
    host's own name; torchrun hands the master node its own hostname) and the others resolve
    to host 0's address: host 0's worker must still publish its reachable address, not
    loopback, or nobody could call it."""
    with Hosts(3) as hosts:
        hosts.hosts_file(0, {"dgmaster": "127.0.1.1"})
        for k in (1, 2):
            hosts.hosts_file(k, {"dgmaster": hosts.address(0)})
        _check(hosts, _run_group(hosts, [], master_host="dgmaster"))


@needs(command("openssl"))
def test_three_hosts_over_mutual_tls(tmp_path: Path) -> None:
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
        _check(hosts, _run_group(hosts, [str(cert), str(key)]))
