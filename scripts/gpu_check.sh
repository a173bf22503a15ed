#!/usr/bin/env bash
# The one GPU check (issue 21): on a fresh GPU machine, from the repository root, set up what
# the GPU tests need, run every GPU test and the CUDA benchmark side by side with TensorPipe,
# and write the results under $OUT (default ./gpu-results). About 8 minutes at most.
#
#   OUT=/some/dir scripts/gpu_check.sh
#
# Python and torch: $GPU_PYTHON (default: the machine's own `python3`) when its torch sees a
# GPU (its version may differ from CI's), else a venv with `pip install torch` (needs the
# network). pytest and
# pytest-timeout: the interpreter's, else pip -- from wheels in $GPU_WHEELS (default
# ./.gpu_wheels: `pip download pytest pytest-timeout -d .gpu_wheels` on a machine with network,
# then carry that folder) when the machine is offline.
# Files written: gpu_check.log (everything), junit.xml (the tests), cuda_bench.txt and
# cuda_bench.json (the benchmark), summary.txt (versions and one line per step's status).
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu-results}"
mkdir -p "$OUT"
exec > >(tee "$OUT/gpu_check.log") 2>&1
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
note() { echo "$*" | tee -a "$SUMMARY"; }
started=$(date +%s)

note "== gpu_check $(date -u +%FT%TZ) commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | tee -a "$SUMMARY"

PY="${GPU_PYTHON:-python3}"
if ! command -v nvidia-smi >/dev/null; then
    note "no GPU on this machine: the GPU tests skip and the benchmark exits 2"
elif ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null
then
    note "$PY has no CUDA torch: making a venv with pip install torch"
    python3 -m venv /tmp/distgrad-gpu-venv && PY=/tmp/distgrad-gpu-venv/bin/python
    "$PY" -m pip install -q torch numpy || note "pip install torch FAILED"
fi
if ! "$PY" -c 'import pytest, pytest_timeout' 2>/dev/null; then
    TOOLS=/tmp/distgrad-gpu-tools  # beside whatever interpreter: no second venv
    WHEELS="${GPU_WHEELS:-$PWD/.gpu_wheels}"
    if [ -d "$WHEELS" ]; then
        "$PY" -m pip install -q --target "$TOOLS" --no-index --find-links "$WHEELS" \
            pytest pytest-timeout
    else
        "$PY" -m pip install -q --target "$TOOLS" pytest pytest-timeout
    fi || note "pytest could not be installed: the tests cannot run"
    export PYTHONPATH="$TOOLS${PYTHONPATH:+:$PYTHONPATH}"
fi
"$PY" -c 'import torch, sys; print("python", sys.version.split()[0], "torch", torch.__version__,
      "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())' 2>&1 | tee -a "$SUMMARY"
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}" TORCH_CPP_LOG_LEVEL=ERROR

# 1. every GPU test (and the CPU tests of the device layer, under this machine's torch)
timeout 330 "$PY" -m pytest -p no:cacheprovider -q -rA --timeout 300 \
    --junitxml="$OUT/junit.xml" \
    tests/e2e/test_cuda.py \
    "tests/e2e/test_payloads.py::test_cuda_tensors_get_the_reference_error" \
    "tests/e2e/test_remote_module.py::test_a_module_on_the_owners_gpu_matches_local" \
    tests/unit/test_device_maps.py tests/unit/test_device_plumbing.py
note "tests: exit $? after $(( $(date +%s) - started ))s"

# 2. the benchmark, side by side with TensorPipe (cuda_ipc and cuda_basic)
timeout 200 "$PY" benchmarks/cuda_bench.py --quick --json "$OUT/cuda_bench.json" \
    2>&1 | tee "$OUT/cuda_bench.txt"
note "cuda_bench: exit ${PIPESTATUS[0]} after $(( $(date +%s) - started ))s"
grep -E "^(CUDA echo|small call|MLP step)" "$OUT/cuda_bench.txt" >>"$SUMMARY" || true
note "== done in $(( $(date +%s) - started ))s"
