#!/usr/bin/env bash
# The torch releases at both ends of the range pyproject.toml declares: for each, a virtual
# environment with distgrad and exactly that torch, then the unit suite, the e2e autograd /
# hooks / RRef / RRef-autograd / DDP files and the demo. (The main suite, scripts/test.sh, runs
# on the torch that scripts/_venv.sh pins.)
#
#   bash scripts/test_torch_versions.sh              # the floor and the newest release on the index
#   bash scripts/test_torch_versions.sh 2.5.1 2.9.1  # these releases
#
# The floor is the lower bound of pyproject's `torch>=X.Y` (the release X.Y.0); the newest is
# what `pip index versions torch` reports (DISTGRAD_TORCH_NEWEST overrides it). Each release's
# environment is kept between runs in $DISTGRAD_TORCH_VENVS (default ~/.cache/distgrad-venvs,
# one folder per release; the default run removes the folders of other releases), and pip's own
# cache is reused, so a second run installs only distgrad. Linux wheels on the index are CUDA
# builds (~2.5-4 GB with their NVIDIA packages); they run on the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY="${PYTHON:-python3}"
CACHE="${DISTGRAD_TORCH_VENVS:-$HOME/.cache/distgrad-venvs}"
E2E=(tests/e2e/test_autograd.py tests/e2e/test_hooks.py tests/e2e/test_rref.py
     tests/e2e/test_rref_autograd.py tests/e2e/test_ddp.py)
# These installs name exact releases: a machine-wide pip constraints file (one that caps torch)
# must not veto them.
export PIP_CONSTRAINT=/dev/null PIP_DISABLE_PIP_VERSION_CHECK=1

floor_release() {
    local floor
    floor=$(sed -n 's/.*"torch>=\([0-9][0-9.]*\)[,"].*/\1/p' pyproject.toml)
    [ -n "$floor" ] || { echo "no torch>=X.Y in pyproject.toml" >&2; exit 2; }
    echo "$floor"
}

newest_release() {
    local newest="${DISTGRAD_TORCH_NEWEST:-}"
    if [ -z "$newest" ]; then
        newest=$("$PY" -m pip index versions torch 2>/dev/null | sed -n 's/^torch (\([0-9.]*\))$/\1/p')
    fi
    [ -n "$newest" ] || { echo "could not ask the package index for torch's newest release" >&2; exit 2; }
    echo "$newest"
}

step() {  # step NAME COMMAND...: run it, note its time and whether it failed; go on either way
    local name=$1 t=$SECONDS
    shift
    if "$@"; then
        LEG+=" $name $((SECONDS - t))s"
    else
        LEG+=" $name FAILED after $((SECONDS - t))s"
        FAILED=1
    fi
}

install_release() {
    local release=$1 venv=$2
    if [ ! -f "$venv/.installed" ]; then
        rm -rf "$venv"
        "$PY" -m venv "$venv"
    fi
    # distgrad's own requirements with exactly this torch: pip fails if the range excludes it
    "$venv/bin/python" -m pip install -q "torch==$release" "$ROOT[test]" &&
        touch "$venv/.installed" &&
        "$venv/bin/python" -c "import torch, numpy; print('torch', torch.__version__, 'numpy', numpy.__version__)"
}

run_release() {
    local release=$1 venv="$CACHE/torch-$1"
    echo "== torch $release ($venv)"
    LEG="torch $release:"
    step install install_release "$release" "$venv"
    if [ -f "$venv/.installed" ]; then
        export PYTHONPATH="$ROOT/src"
        step unit "$venv/bin/python" -m pytest tests/unit -q -p no:cacheprovider
        step e2e "$venv/bin/python" -m pytest "${E2E[@]}" -q -p no:cacheprovider
        step demo timeout 300 "$venv/bin/python" -m distgrad demo
        unset PYTHONPATH
    fi
    TIMES+=("$LEG")
}

TIMES=()
FAILED=0
if [ $# -gt 0 ]; then
    releases=("$@")
else
    releases=("$(floor_release)" "$(newest_release)")
    if [ -d "$CACHE" ]; then  # only the releases tested now keep their environments
        for dir in "$CACHE"/torch-*; do
            [ -e "$dir" ] || continue
            case " ${releases[*]} " in
                *" ${dir##*/torch-} "*) ;;
                *) rm -rf "$dir" ;;
            esac
        done
    fi
fi
mkdir -p "$CACHE"
for release in "${releases[@]}"; do
    run_release "$release"
done
echo "== torch versions"
printf '%s\n' "${TIMES[@]}"
exit "$FAILED"
