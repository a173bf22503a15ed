# Sourced by the set-up scripts: create .venv (Python >= 3.10) if missing and install torch,
# pinned here to the CPU build 2.13.0 (the package itself only asks for a range).
VENV="${DISTGRAD_VENV:-.venv}"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
pip_install() { "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$@"; }
pip_install "torch==2.13.0"
