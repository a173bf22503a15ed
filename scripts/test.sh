#!/usr/bin/env bash
# Set up a virtual environment (.venv) with distgrad and its test tools, then run the checks:
# ruff (lint + format), mypy (strict, the package), and the test suite.
# Works on a fresh machine with Python >= 3.10; torch is pinned to the CPU build 2.13.0 here.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${DISTGRAD_VENV:-.venv}"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check "torch==2.13.0"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check -e ".[dev]"
echo "== ruff"
"$VENV/bin/ruff" check .
"$VENV/bin/ruff" format --check .
echo "== mypy"
"$VENV/bin/mypy"
echo "== pytest"
"$VENV/bin/python" -m pytest "$@"
