#!/usr/bin/env bash
# The charlm runs of the methods that talk every H steps (dlocal_mavo, DiLoCo; see
# docs/results.md, "Talking every H steps"): a queue in priority order, run two at a
# time, one torch thread each, N = 4, 2000 steps, the lr / weight decay of the
# every-step method with the same inner optimizer from docs/results/charlm/tuned.json.
# Resumable: run it again and the runs already in $OUT/runs.jsonl are skipped, and so
# are runs going on in another process (a run cut off in the middle starts again from
# step 0). Runs of the queue started by hand (`one`) count against the two at a time.
#
#   nohup scripts/charlm_local_queue.sh > charlm-local-queue.log 2>&1 &
#   scripts/charlm_local_queue.sh list        # the queue, each entry done or not
#   scripts/charlm_local_queue.sh one SPEC SEED   # one run (what the queue calls)
#   CONFIG=F TAG=lr2e-4 scripts/charlm_local_queue.sh one SPEC SEED   # the same spec at another
#                                                # config's lr: TAG keeps its shard apart
#
# Each run writes its own shard $OUT/shards/<spec>_s<seed>/runs.jsonl and is then
# appended to $OUT/runs.jsonl (under a lock). Plot / summary:
#   python -m dlion.lab.experiments.local_plot docs/results/charlm/runs.jsonl $OUT/runs.jsonl --out $OUT
set -euo pipefail
OUT=${OUT:-docs/results/charlm-local}
PY=${PYTHON:-python}
CONFIG=${CONFIG:-docs/results/charlm/tuned.json}
JOBS=${JOBS:-2}
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1

# SPEC SEED, highest priority first
QUEUE="
dlocal_mavo:10 0
dlocal_mavo:10 1
dlocal_mavo:10 2
diloco_adamw:10 0
diloco_adamw:10 1
diloco_adamw:10 2
dlocal_mavo:5 0
dlocal_mavo:25 0
dlocal_mavo:50 0
dlocal_mavo:100 0
diloco_adamw:25 0
diloco_adamw:50 0
diloco_adamw:100 0
diloco_adamw_bf16:10 0
diloco_lion:10 0
diloco_lion:10:outer_lr=0.1 0
"

mkdir -p "$OUT/shards"

# exit 0 if the run SPEC SEED is in $OUT/runs.jsonl
is_done() {
    $PY - "$OUT/runs.jsonl" "$CONFIG" "$1" "$2" <<'EOF'
import json, sys
from dlion.lab.experiments.runner import canonical, hparams_for, load_runs, run_key
path, config, spec, seed = sys.argv[1], json.load(open(sys.argv[2])), canonical(sys.argv[3]), int(sys.argv[4])
key = run_key("charlm", spec, 4, seed, 2000, hparams_for(config, "charlm", spec))
sys.exit(0 if any(r["key"] == key for r in load_runs(path)) else 1)
EOF
}

case "${1:-queue}" in
list)
    echo "$QUEUE" | while read -r spec seed; do
        [ -z "$spec" ] && continue
        if is_done "$spec" "$seed"; then echo "done  $spec seed=$seed"; else echo "todo  $spec seed=$seed"; fi
    done
    ;;
one)
    spec=${2:?spec}
    seed=${3:?seed}
    name="$(echo "$spec" | tr ':=' '-_')${TAG:+-$TAG}_s$seed"
    dir="$OUT/shards/$name"
    # one copy of a run at a time: a lock per run, and no second copy of one started without it
    mkdir -p "$OUT/.locks"
    exec 8> "$OUT/.locks/$name"
    if ! flock -n 8 || pgrep -f -- "--out $dir --resume" > /dev/null; then
        echo "$(date +%T) skip $spec seed=$seed (running in another process)"
        exit 0
    fi
    if is_done "$spec" "$seed"; then
        echo "$(date +%T) skip $spec seed=$seed (in $OUT/runs.jsonl)"
        exit 0
    fi
    echo "$(date +%T) start $spec seed=$seed -> $dir"
    $PY -m dlion experiment --task charlm --methods "$spec" --workers 4 --seeds "$seed" --steps 2000 \
        --config "$CONFIG" --out "$dir" --resume --quiet --threads 1 > /dev/null
    find "$dir" -type f ! -name runs.jsonl -delete  # the per-shard summary and figures
    (
        flock 9
        $PY - "$dir/runs.jsonl" "$OUT/runs.jsonl" <<'EOF'
import json, sys
from dlion.lab.experiments.runner import _append, load_runs, repair
src, dst = sys.argv[1], sys.argv[2]
repair(dst)
have = {r["key"] for r in load_runs(dst)}
for r in load_runs(src):
    if r["key"] not in have:
        _append(dst, r)
        print(f"{r['method']} seed={r['seed']}: final {r['metric']} {r['final']:.4f}, {r['seconds']:.0f} s, "
              f"{r['bits']:.4g} bits/param/step")
EOF
    ) 9> "$OUT/.merge.lock"
    ;;
queue)
    # two at a time, in order; a failed run does not stop the others
    echo "$QUEUE" | grep -v '^$' | xargs -P "$JOBS" -L 1 "$0" one || true
    echo "$(date +%T) queue finished"
    "$0" list
    ;;
*)
    echo "usage: $0 [queue|list|one SPEC SEED]" >&2
    exit 2
    ;;
esac
