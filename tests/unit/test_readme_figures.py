"""The README states one duration for the whole test suite (issue 23, item 10)."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_gives_one_duration_for_the_test_suite() -> None:
    """Every "about N min(utes)" the README gives for ``scripts/test.sh`` / the test suite is
    the same figure (the quick start once said 11, the paragraph below it 18)."""
    text = README.read_text()
    figures = set()
    for line_no, line in enumerate(text.splitlines()):
        if "test.sh" in line or "test suite" in line:
            window = "\n".join(text.splitlines()[line_no : line_no + 2])
            match = re.search(r"about (\d+) min", window)
            if match:  # ("about 1.5 minutes" for the unit tests alone does not match)
                figures.add(int(match.group(1)))
    assert len(figures) == 1, figures
