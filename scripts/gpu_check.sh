#!/usr/bin/env bash
# The one GPU check (issue 29): on a GPU machine, from the repository root, run a pre-flight,
# every GPU test and the CUDA benchmark side by side with TensorPipe, writing every result
# under $OUT (default ./gpu-results) as it happens. Under 5 minutes on one H100, so a rerun
# fits a session's GPU time; no network used (the GPU machine has none).
#
#   OUT=/some/dir scripts/gpu_check.sh
#
# Python: $GPU_PYTHON (default: the machine's `python3`, whose torch is a CUDA build -- its
# version may differ from CI's), with pytest, pytest-timeout and expecttest (the GPU image has
# the first two, not expecttest: carry wheels in $GPU_WHEELS, default ./.gpu_wheels, made with
# `pip download --no-deps --only-binary=:all: expecttest -d .gpu_wheels` -- and name the
# folder in the device tool's `carry`).
# Files written: gpu_check.log (everything), preflight.txt, ipc_profile.txt (if asked), cuda_cases.jsonl (a line as each
# case of tests/e2e/test_cuda.py starts and ends), junit.xml (the tests), junit_torch.xml
# (torch's own CUDA test classes through the switch),
# cuda_bench.txt and cuda_bench.json (the benchmark, after each implementation), summary.txt.
# Exit status: 0 only when the pre-flight passed, tests ran and none failed, and the
# benchmark ran; 1 otherwise; 2 without a GPU.
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu-results}"
mkdir -p "$OUT"
exec > >(tee "$OUT/gpu_check.log") 2>&1
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
note() { echo "$*" | tee -a "$SUMMARY"; }
started=$(date +%s)
status=0
cleanup() {  # no worker outlives the check, whatever stopped it
    pkill -9 -f "multiprocessing.spawn" 2>/dev/null
    pkill -9 -f "benchmarks/_common" 2>/dev/null
    true
}
trap cleanup EXIT

note "== gpu_check $(date -u +%FT%TZ) commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
if ! command -v nvidia-smi >/dev/null; then
    note "no GPU on this machine: nothing to check"
    exit 2
fi
PY="${GPU_PYTHON:-python3}"
# pytest, pytest-timeout, and expecttest (torch's test modules import it; the GPU image of
# 11-28 lacks it): from wheels carried in $GPU_WHEELS where the interpreter lacks them
MISSING=""
for pkg in pytest pytest_timeout expecttest; do
    "$PY" -c "import $pkg" 2>/dev/null || MISSING="$MISSING ${pkg//_/-}"
done
if [ -n "$MISSING" ]; then
    TOOLS=/tmp/distgrad-gpu-tools
    "$PY" -m pip install -q --target "$TOOLS" --no-index --no-deps \
        --find-links "${GPU_WHEELS:-$PWD/.gpu_wheels}" $MISSING \
        || note "could not install$MISSING (no wheels in \$GPU_WHEELS)"
    export PYTHONPATH="$TOOLS${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}" TORCH_CPP_LOG_LEVEL=ERROR
export PYTHONUNBUFFERED=1 DISTGRAD_GPU_RESULTS="$OUT"
PYLOG=$(mktemp)  # pytest's output (also in gpu_check.log: $OUT may hold 8 files)

# 0. pre-flight (versions, pinned memory across processes, the device-aware future): < 30 s
timeout -k 5 40 "$PY" scripts/gpu_preflight.py 2>&1 | tee "$OUT/preflight.txt"
rc=${PIPESTATUS[0]}
note "preflight: exit $rc after $(( $(date +%s) - started ))s"
grep -E "^(ok|FAIL)" "$OUT/preflight.txt" >>"$SUMMARY"
[ "$rc" = 0 ] || status=1

# 0b. (GPU_CHECK_IPC_PROFILE=1) where a CUDA IPC transfer's time goes: about 30 s
if [ "${GPU_CHECK_IPC_PROFILE:-0}" = 1 ]; then
    timeout -k 5 60 "$PY" scripts/gpu_ipc_profile.py 2>&1 | tee "$OUT/ipc_profile.txt"
    note "ipc_profile: exit ${PIPESTATUS[0]} after $(( $(date +%s) - started ))s"
    grep " B " "$OUT/ipc_profile.txt" >>"$SUMMARY"
fi

# 1. every GPU test (and the CPU tests of the device layer, under this machine's torch).
# SIGINT first, so pytest still writes its junit file and summary.
timeout -k 15 -s INT 200 "$PY" -m pytest -p no:cacheprovider -v -rA --timeout 190 \
    --junitxml="$OUT/junit.xml" \
    tests/e2e/test_cuda.py \
    "tests/e2e/test_payloads.py::test_cuda_tensors_get_the_reference_error" \
    "tests/e2e/test_remote_module.py::test_a_module_on_the_owners_gpu_matches_local" \
    tests/unit/test_device_maps.py tests/unit/test_device_plumbing.py 2>&1 | tee "$PYLOG"
rc=${PIPESTATUS[0]}
cleanup
counts=$(grep -E "^=+ .*(passed|failed|error).* in " "$PYLOG" | tail -1)
note "tests: exit $rc after $(( $(date +%s) - started ))s: ${counts:-no summary}"
grep -E "^(PASSED|FAILED|ERROR|SKIPPED)" "$PYLOG" | grep -v "test_device_maps\|test_device_plumbing" >>"$SUMMARY"
if [ "$rc" != 0 ] || ! echo "$counts" | grep -q passed; then status=1; fi
if echo "$counts" | grep -qE "skipped" && grep -q "SKIPPED.*test_cuda" "$PYLOG"; then
    note "GPU tests were skipped: counted as a failure"; status=1
fi

# 1b. torch's own CUDA RPC test classes through the switch: the cases one GPU runs
KEYS=$("$PY" tests/e2e/torch_cuda_suites.py)
XDIST=$("$PY" -c 'import xdist' 2>/dev/null && echo "-n 6")
timeout -k 15 -s INT 120 "$PY" -m pytest -p no:cacheprovider -q -rA $XDIST --timeout 110 \
    --junitxml="$OUT/junit_torch.xml" tests/e2e/torch_cuda_suites.py -k "$KEYS" 2>&1 | tee "$PYLOG"
rc=${PIPESTATUS[0]}
cleanup
counts=$(grep -E "^=+ .*(passed|failed|error).* in " "$PYLOG" | tail -1)
note "torch's CUDA suites: exit $rc after $(( $(date +%s) - started ))s: ${counts:-no summary}"
grep -E "^(PASSED|FAILED|ERROR|SKIPPED)" "$PYLOG" >>"$SUMMARY"
if [ "$rc" != 0 ] || ! echo "$counts" | grep -q passed; then status=1; fi

# 2. the benchmark, side by side with TensorPipe (cuda_ipc and cuda_basic)
timeout -k 10 -s INT 100 "$PY" benchmarks/cuda_bench.py --quick --json "$OUT/cuda_bench.json" \
    2>&1 | tee "$OUT/cuda_bench.txt"
rc=${PIPESTATUS[0]}
cleanup
note "cuda_bench: exit $rc after $(( $(date +%s) - started ))s"
grep -E "^(CUDA echo|small call|MLP step)" "$OUT/cuda_bench.txt" | tail -6 >>"$SUMMARY" || true
[ "$rc" = 0 ] || status=1
note "== done in $(( $(date +%s) - started ))s: exit $status"
exit $status
