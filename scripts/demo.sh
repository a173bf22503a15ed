#!/usr/bin/env bash
# Set up a virtual environment (.venv) with distgrad, then run the demo: several local worker
# processes doing real work over distgrad's RPC. Extra arguments go to `distgrad demo`.
# Works on a fresh machine with Python >= 3.10; torch is pinned to the CPU build 2.13.0 here.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${DISTGRAD_VENV:-.venv}"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check "torch==2.13.0"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check -e ".[uvloop]"
exec "$VENV/bin/python" -m distgrad demo "$@"
