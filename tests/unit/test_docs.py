"""The README and docs say what the checkout has: the files and commands they name exist, and
their statements about the code's structure match the code."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from distgrad import _config
from distgrad._wire._frames import Kind

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "examples/README.md"]


def _text(path: Path) -> str:
    return path.read_text()


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_point_at_files(page: Path) -> None:
    """Every relative Markdown link resolves to a file or folder of the checkout."""
    for target in re.findall(r"\]\(([^)#\s]+)", _text(page)):
        if "://" in target:
            continue
        assert (page.parent / target).exists(), f"{page.name} links to missing {target}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_named_scripts_and_examples_exist(page: Path) -> None:
    """Every ``examples/*.py``, ``benchmarks/*.py`` and ``scripts/*`` path a page names (in a
    command or in prose) exists: a newcomer following it literally finds the file."""
    for path in re.findall(r"\b((?:examples|benchmarks|scripts)/[\w./-]+\.(?:py|sh))", _text(page)):
        assert (REPO / path).exists(), f"{page.name} names missing {path}"


def test_readme_launcher_command_names_an_existing_script() -> None:
    """The README's ``distgrad run`` command runs a script that exists and takes the options
    it passes."""
    command = re.search(
        r"distgrad run -n \d+ (\S+\.py)((?: --[\w-]+ \S+)*)", _text(REPO / "README.md")
    )
    assert command is not None
    script = REPO / command.group(1)
    assert script.exists(), command.group(0)
    for option in re.findall(r"--[\w-]+", command.group(2)):
        assert f'"{option}"' in script.read_text(), f"{script.name} takes no {option}"


def test_design_lists_every_frame_kind() -> None:
    """docs/design.md's list of frame kinds (the paragraph that says "Kinds:") names every
    frame kind the code defines."""
    paragraphs = _text(REPO / "docs/design.md").split("\n\n")
    listing = next(p for p in paragraphs if "Kinds:" in p)
    for kind in Kind:
        assert f"`{kind.name}`" in listing, kind.name


def test_environment_variables_are_documented_and_real() -> None:
    """Every ``DISTGRAD_*`` variable in ``_config`` is in the README's configuration table,
    and every ``DISTGRAD_*`` name the docs mention is one the code or the scripts use."""
    defined = {value for name, value in vars(_config).items() if name.startswith("ENV_")}
    readme = _text(REPO / "README.md")
    for variable in defined:
        assert f"`{variable}" in readme, variable
    sources = [*(REPO / "src").rglob("*.py"), *(REPO / "scripts").iterdir()]
    used = {v for path in sources for v in re.findall(r"\bDISTGRAD_[A-Z_]+", _text(path))}
    for page in PAGES:
        for variable in set(re.findall(r"\bDISTGRAD_[A-Z_]+", _text(page))):
            assert variable in used, f"{page.name} names {variable}, which nothing reads"


def test_design_does_not_claim_public_modules_only_reexport() -> None:
    """docs/design.md describes the public modules as they are: they also define torch's
    private helpers (``rpc._get_current_rpc_agent``, ``dist_autograd._new_context``) and wire
    things up at import, which the page names."""
    import distgrad.autograd as dist_autograd
    import distgrad.rpc as rpc

    design = _text(REPO / "docs/design.md")
    assert "only\nre-export" not in design and "only re-export" not in design
    assert rpc._get_current_rpc_agent.__module__.startswith("distgrad.rpc")
    assert dist_autograd._new_context.__module__ == "distgrad.autograd"
    assert "`rpc._get_current_rpc_agent`" in design and "`dist_autograd._new_context`" in design
