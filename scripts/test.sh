#!/usr/bin/env bash
# Set up a virtual environment (.venv) with distgrad and its test tools, then run the checks:
# ruff (lint + format), mypy (strict, the package), and the test suite (less the tests of real
# libraries, marked `libraries`: scripts/test_libraries.sh runs them in their own environment).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_venv.sh
pip_install -e ".[dev]"
echo "== ruff"
"$VENV/bin/ruff" check .
"$VENV/bin/ruff" format --check .
echo "== mypy"
"$VENV/bin/mypy"
echo "== pytest"
"$VENV/bin/python" -m pytest -m "not libraries" "$@"
