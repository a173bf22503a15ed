"""Parsing of ``remote_device`` strings: ``"<worker>/<device>"``, ``"rank:<r>/<device>"``, or a
worker alone (device ``cpu``), as torch's ``torch.distributed._remote_device``."""

from __future__ import annotations

import torch

__all__ = ["parse_remote_device"]


def _is_device(text: str) -> bool:
    try:
        torch.device(text)
    except Exception:
        return False
    return True


def parse_remote_device(remote_device: str | torch.device) -> tuple[str | int | None, torch.device]:
    """``(worker name, or rank, or None for a local device; device)``."""
    error = (
        f"Could not parse remote_device: {remote_device}. The valid format is "
        "'<workername>/<device>' or 'rank:<rank>/<device>' or '<device>'"
    )
    if isinstance(remote_device, torch.device):
        return None, remote_device
    if not isinstance(remote_device, str):
        raise TypeError(f"Invalid type for remote_device: {type(remote_device)}")
    fields = remote_device.split("/")
    worker: str | None
    if len(fields) == 2:
        worker, device = fields
    elif len(fields) == 1:
        worker, device = (None, fields[0]) if _is_device(fields[0]) else (fields[0], "cpu")
    else:
        raise ValueError(error)
    if worker is not None and not worker:
        raise ValueError(error)
    parsed = torch.device(device)
    if worker is None:
        return None, parsed
    parts = worker.split(":")
    if len(parts) == 2:
        if parts[0] == "rank" and parts[1].isdigit():
            return int(parts[1]), parsed
        raise ValueError(error)
    if len(parts) > 2:
        raise ValueError(error)
    return worker, parsed
