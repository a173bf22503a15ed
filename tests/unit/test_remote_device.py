"""Unit tests of the parts of RemoteModule and DistributedOptimizer that need no worker:
remote_device parsing, the not-initialized error, the public names."""

from __future__ import annotations

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
