"""Several "hosts" on one machine: network namespaces joined by veth pairs to a bridge.

``Hosts(n)`` (a context manager) makes a *switch* namespace holding a Linux bridge and ``n``
host namespaces, each with one interface ``eth0`` at ``10.213.0.<k+1>/24`` whose veth peer is a
port of the bridge, plus loopback. Processes started with :meth:`Hosts.popen` run inside a
host's namespace (``ip netns exec``), in their own process group. :meth:`Hosts.partition` takes a
host's bridge port down (its traffic to every other host is dropped, its sockets stay open) and
:meth:`Hosts.heal` brings it back.

Leaving the block kills every process started there (the whole process group) and deletes the
namespaces, which removes their interfaces: nothing outlives the test. Namespaces need root and
``ip``; :func:`unavailable` says why they cannot be made here, for ``tests._needs.needs``: a
clean skip, or a failure in CI.

The addresses are private to these namespaces: no packet leaves them.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Mapping, Sequence
from types import TracebackType

__all__ = ["Hosts", "unavailable"]

SUBNET = "10.213.0"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True, timeout=30)


_reason: str | None = None
_probed = False


def unavailable() -> str | None:
    """Why namespaces cannot be made here (None when they can): probed once."""
    global _reason, _probed
    if _probed:
        return _reason
    _probed = True
    if os.geteuid() != 0:
        _reason = "network namespaces need root"
    elif shutil.which("ip") is None:
        _reason = "no `ip` command (iproute2)"
    else:
        name = f"dgprobe{uuid.uuid4().hex[:8]}"
        try:
            done = _ip("netns", "add", name, check=False)
            if done.returncode != 0:
                _reason = f"cannot create a network namespace: {done.stderr.strip()}"
            else:
                bridge = _ip("-n", name, "link", "add", "br0", "type", "bridge", check=False)
                if bridge.returncode != 0:
                    _reason = f"cannot create a bridge: {bridge.stderr.strip()}"
        finally:
            _ip("netns", "del", name, check=False)
    return _reason


class Hosts:
    """``n`` namespaces on one bridge; ``address(k)`` is host ``k``'s IPv4 address."""

    def __init__(self, n: int) -> None:
        tag = uuid.uuid4().hex[:6]
        self.switch = f"dgsw{tag}"
        self.names = [f"dgh{k}{tag}" for k in range(n)]
        self._procs: list[subprocess.Popen[str]] = []

    def address(self, k: int) -> str:
        return f"{SUBNET}.{k + 1}"

    def _port(self, k: int) -> str:
        return f"dgp{k}{self.switch[4:]}"

    def __enter__(self) -> Hosts:
        try:
            _ip("netns", "add", self.switch)
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            for k, name in enumerate(self.names):
                _ip("netns", "add", name)
                _ip("-n", name, "link", "set", "lo", "up")
                port = self._port(k)
                _ip("link", "add", port, "type", "veth", "peer", "name", f"dge{k}{self.switch[4:]}")
                _ip("link", "set", f"dge{k}{self.switch[4:]}", "netns", name)
                _ip("-n", name, "link", "set", f"dge{k}{self.switch[4:]}", "name", "eth0")
                _ip("-n", name, "addr", "add", f"{self.address(k)}/24", "dev", "eth0")
                _ip("-n", name, "link", "set", "eth0", "up")
                _ip("link", "set", port, "netns", self.switch)
                _ip("-n", self.switch, "link", "set", port, "master", "br0")
                _ip("-n", self.switch, "link", "set", port, "up")
        except BaseException:
            self.close()
            raise
        return self

    def popen(
        self,
        k: int,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        *,
        stdin: bool = False,
    ) -> subprocess.Popen[str]:
        """Start ``argv`` inside host ``k`` (its own process group; output captured; with
        ``stdin``, a pipe to write its standard input)."""
        proc = subprocess.Popen(
            ["ip", "netns", "exec", self.names[k], *argv],
            env=dict(env) if env is not None else None,
            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self._procs.append(proc)
        return proc

    def hosts_file(self, k: int, entries: Mapping[str, str]) -> None:
        """Give host ``k`` its own ``/etc/hosts`` (``name -> address``): ``ip netns exec``
        mounts ``/etc/netns/<name>/hosts`` over it for the processes it starts."""
        directory = f"/etc/netns/{self.names[k]}"
        os.makedirs(directory, exist_ok=True)
        lines = ["127.0.0.1 localhost", *(f"{a} {n}" for n, a in entries.items())]
        with open(f"{directory}/hosts", "w") as f:
            f.write("\n".join(lines) + "\n")

    def partition(self, k: int) -> None:
        """Cut host ``k`` off from every other host (its bridge port goes down)."""
        _ip("-n", self.switch, "link", "set", self._port(k), "down")

    def heal(self, k: int) -> None:
        _ip("-n", self.switch, "link", "set", self._port(k), "up")

    def close(self) -> None:
        for proc in self._procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for proc in self._procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
        for name in self.names:
            shutil.rmtree(f"/etc/netns/{name}", ignore_errors=True)
        for name in [*self.names, self.switch]:
            for _ in range(3):
                if _ip("netns", "del", name, check=False).returncode == 0:
                    break
                time.sleep(0.1)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
