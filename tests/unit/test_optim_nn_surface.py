"""Unit tests of the parts of RemoteModule and DistributedOptimizer that need no worker:
remote_device parsing, the not-initialized error, the public names, the layering."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import distgrad.nn
import distgrad.optim
from distgrad._nn._remote_device import parse_remote_device


@pytest.mark.parametrize(
    ("text", "on", "device"),
    [
        ("worker1/cpu", "worker1", "cpu"),
        ("worker1", "worker1", "cpu"),
        ("ps0/cuda:1", "ps0", "cuda:1"),
        ("rank:3/cpu", 3, "cpu"),
        ("rank:0", 0, "cpu"),
        ("cuda:0", None, "cuda:0"),
        ("cpu", None, "cpu"),
    ],
)
def test_remote_device_forms(text: str, on: str | int | None, device: str) -> None:
    """Every form torch's _remote_device accepts parses to the same worker and device."""
    assert parse_remote_device(text) == (on, torch.device(device))


@pytest.mark.parametrize("text", ["a/b/c", "/cpu", "rank:x/cpu", "a:b:c/cpu", "w/notadevice"])
def test_bad_remote_devices(text: str) -> None:
    """Malformed remote devices raise ValueError (torch's parse message, or torch.device's)."""
    with pytest.raises((ValueError, RuntimeError)):
        parse_remote_device(text)


def test_remote_module_needs_rpc() -> None:
    """Without init_rpc, RemoteModule raises the reference's AssertionError."""
    with pytest.raises(AssertionError, match=r"^RemoteModule only works in RPC\.$"):
        distgrad.nn.RemoteModule("worker1/cpu", torch.nn.Linear, (2, 2))


def test_public_names() -> None:
    """The public classes report their public module, and torch's module path exists too."""
    from distgrad.nn.api.remote_module import RemoteModule

    assert RemoteModule is distgrad.nn.RemoteModule
    assert distgrad.nn.RemoteModule.__module__ == "distgrad.nn"
    assert distgrad.optim.DistributedOptimizer.__module__ == "distgrad.optim"
    assert distgrad.nn.__all__ == ["RemoteModule"]
    assert distgrad.optim.__all__ == ["DistributedOptimizer"]


def test_rpc_and_autograd_do_not_import_layer_five() -> None:
    """Layering: importing the RPC and autograd layers loads neither optim nor nn."""
    code = (
        "import sys, distgrad.rpc, distgrad.autograd; "
        "print(sorted(m for m in sys.modules if m.startswith(('distgrad._optim', "
        "'distgrad._nn', 'distgrad.optim', 'distgrad.nn'))))"
    )
    src = str(Path(__file__).resolve().parents[2] / "src")
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PYTHONPATH": src},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert out.stdout.strip() == "[]"
