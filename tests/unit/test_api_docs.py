"""docs/api.md is what scripts/gen_api_docs.py makes from the current docstrings."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[2]


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "gen_api_docs", REPO / "scripts" / "gen_api_docs.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_api_reference_is_up_to_date() -> None:
    """Regenerating the API reference gives docs/api.md byte for byte (else: run
    ``python scripts/gen_api_docs.py``)."""
    generated = _generator().render()
    assert (REPO / "docs" / "api.md").read_text() == generated, (
        "docs/api.md is out of date: run python scripts/gen_api_docs.py"
    )


def test_api_reference_lists_every_public_name() -> None:
    """Every name in the public modules' __all__ appears in the reference."""
    import distgrad.autograd
    import distgrad.nn
    import distgrad.optim
    import distgrad.rpc

    text = (REPO / "docs" / "api.md").read_text()
    for module in (distgrad.rpc, distgrad.autograd, distgrad.optim, distgrad.nn):
        for name in module.__all__:
            assert f"`{module.__name__}.{name}" in text, f"{module.__name__}.{name} missing"
