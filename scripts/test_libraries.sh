#!/usr/bin/env bash
# Real libraries, unchanged, on distgrad (docs/libraries.md): make their own virtual
# environment (.venv-libraries: torch 2.13.0 and the libraries pinned in
# requirements-libraries.txt), install this tree's distgrad into it as a user would (not
# editable: the DISTGRAD_PATCH_TORCH start-up hook lands in site-packages), and run the tests
# marked `libraries` -- with DISTGRAD_REQUIRE_LIBRARIES=1, so that a library that does not
# import fails them instead of skipping them. The core suite (scripts/test.sh) does not depend
# on any of this.
set -euo pipefail
cd "$(dirname "$0")/.."
DISTGRAD_VENV=.venv-libraries
source scripts/_venv.sh
pip_install -r requirements-libraries.txt "pytest>=7.4" "pytest-timeout>=2.2"
pip_install --force-reinstall --no-deps .
echo "== pytest -m libraries"
DISTGRAD_REQUIRE_LIBRARIES=1 "$VENV/bin/python" -m pytest -m libraries tests/libraries "$@"
