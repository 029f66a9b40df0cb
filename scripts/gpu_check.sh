#!/usr/bin/env bash
# The one-command CUDA check: records the GPU and versions, runs tests/test_cuda.py, then times a step's kernels
# (scripts/gpu_check.py); logs + JSON go to ${OUT:-docs/results/gpu-check}. ~2-4 min on one H100, never over 6.
set -u  # (no -e: a failing stage never stops the next one; exit status 0 only if every stage passed)
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 1
PY="${PYTHON:-python3}"          # the interpreter with torch
OUTDIR="${OUT:-docs/results/gpu-check}"
mkdir -p "$OUTDIR"
OUTDIR="$(cd "$OUTDIR" && pwd)"
# at most 8 files come back from $OUT: these 7, no stale ones from an earlier run
FILES=(env.log pytest.log pytest.xml gpu_check.log gpu_check.json cuda_sync_counts.json summary.json)
for f in "${FILES[@]}"; do rm -f "$OUTDIR/$f"; done
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
export GPU_CHECK_OUT="$OUTDIR"    # tests/test_cuda.py writes its sync counts there
export PYTHONUNBUFFERED=1
TOTAL_S="${TOTAL_S:-345}"        # every stage is killed at min(its limit, what is left of this)
START=$(date +%s)

NAMES=(); STATUS=(); SECS=(); LOGS=(); DETAIL=()

# stage NAME LIMIT_S LOG CMD...: run CMD with output to stdout and LOG, killed after
# min(LIMIT_S, time left); records its status
stage() {
    local name=$1 limit=$2 log=$3; shift 3
    local now left rc t0 t1 status
    now=$(date +%s); left=$((START + TOTAL_S - now))
    (( limit > left )) && limit=$left
    echo; echo "=== $name (limit ${limit}s) ==="
    if (( limit < 5 )); then
        echo "$name skipped: no time left" | tee -a "$OUTDIR/$log"
        NAMES+=("$name"); STATUS+=("SKIPPED (no time)"); SECS+=(0); LOGS+=("$log"); DETAIL+=("")
        return
    fi
    t0=$(date +%s.%N)
    timeout -k 5 "$limit" "$@" 2>&1 | tee -a "$OUTDIR/$log"
    rc=${PIPESTATUS[0]}
    t1=$(date +%s.%N)
    case $rc in
        0) status="ok" ;;
        124|137) status="TIMEOUT after ${limit}s" ;;
        *) status="FAILED (exit $rc)" ;;
    esac
    NAMES+=("$name"); STATUS+=("$status"); LOGS+=("$log"); DETAIL+=("")
    SECS+=("$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f", b - a }')")
}

stage "nvidia-smi" 15 env.log bash -c \
    'if command -v nvidia-smi >/dev/null; then nvidia-smi && nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.memory,power.limit --format=csv; else echo "nvidia-smi: not found (no NVIDIA driver here)"; fi'

stage "versions" 40 env.log "$PY" -c '
import platform, sys, torch, numpy
import torch.distributed as dist
import dlion
print("python", platform.python_version(), "|", sys.executable.rsplit("/", 1)[-1])
print("torch", torch.__version__, "| CUDA", torch.version.cuda, "| cuDNN", torch.backends.cudnn.version())
print("numpy", numpy.__version__, "| dlion", dlion.__version__, "from", dlion.__file__.rsplit("/src/", 1)[-1])
print("distributed", dist.is_available(), "| gloo", dist.is_available() and dist.is_gloo_available(),
      "| nccl", dist.is_available() and dist.is_nccl_available())
print("cuda available", torch.cuda.is_available(), "| devices", torch.cuda.device_count())
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"  cuda:{i}", p.name, f"sm_{p.major}{p.minor}", f"{p.total_memory / 2**30:.1f} GiB", f"{p.multi_processor_count} SMs")
from dlion import kernels
print("dlion native CPU kernels", kernels.available())
'

# one hung test must not cost the others: a per-test limit where pytest-timeout is installed
PER_TEST=(); "$PY" -c "import pytest_timeout" 2>/dev/null && PER_TEST=(--timeout=100)
stage "pytest tests/test_cuda.py" 200 pytest.log "$PY" -m pytest -q -rA -p no:cacheprovider ${PER_TEST[@]+"${PER_TEST[@]}"} \
    --junitxml="$OUTDIR/pytest.xml" tests/test_cuda.py

stage "scripts/gpu_check.py" 120 gpu_check.log "$PY" scripts/gpu_check.py --out "$OUTDIR"

# -- one summary -------------------------------------------------------------------------------
ELAPSED=$(( $(date +%s) - START ))
PYT="$(grep -E '^(=+ )?[0-9]+ (passed|failed|skipped|error|errors|xfailed|xpassed)' "$OUTDIR/pytest.log" 2>/dev/null | tail -1 | sed 's/=//g; s/^ *//; s/ *$//')"
FAILED_TESTS="$(grep -E '^(FAILED|ERROR) ' "$OUTDIR/pytest.log" 2>/dev/null)"
GPUC="$(grep -E '^[0-9]+ rows, [0-9]+ failed' "$OUTDIR/gpu_check.log" 2>/dev/null | tail -1)"
DETAIL[2]="$PYT"; DETAIL[3]="$GPUC"
ALL_OK=1
{
    echo
    echo "## gpu_check summary ($(date -u +%Y-%m-%dT%H:%M:%SZ), ${ELAPSED}s, output in ${OUT:-docs/results/gpu-check})"
    echo
    echo "| stage | status | seconds | detail | log |"
    echo "|---|---|---:|---|---|"
    for i in "${!NAMES[@]}"; do
        [[ ${STATUS[$i]} == ok ]] || ALL_OK=0
        echo "| ${NAMES[$i]} | ${STATUS[$i]} | ${SECS[$i]} | ${DETAIL[$i]} | ${LOGS[$i]} |"
    done
    if [[ -n "$FAILED_TESTS" ]]; then
        echo; echo "failed tests:"; echo "$FAILED_TESTS"
    fi
}

# the same as JSON (stage, status, seconds, detail)
{
    echo "{\"elapsed_s\": $ELAPSED, \"all_ok\": $([[ $ALL_OK == 1 ]] && echo true || echo false), \"stages\": ["
    for i in "${!NAMES[@]}"; do
        sep=","; (( i == ${#NAMES[@]} - 1 )) && sep=""
        printf '  {"stage": "%s", "status": "%s", "seconds": %s, "detail": "%s", "log": "%s"}%s\n' \
            "${NAMES[$i]}" "${STATUS[$i]}" "${SECS[$i]}" "${DETAIL[$i]//\"/\'}" "${LOGS[$i]}" "$sep"
    done
    echo "]}"
} > "$OUTDIR/summary.json"
[[ $ALL_OK == 1 ]]
