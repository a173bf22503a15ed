#!/usr/bin/env bash
# Set up a virtual environment (.venv) with distgrad, then run the demo: several local worker
# processes doing real work over distgrad's RPC. Extra arguments go to `distgrad demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_venv.sh
pip_install -e ".[uvloop,demo]"
exec "$VENV/bin/python" -m distgrad demo "$@"
