#!/usr/bin/env bash
# The charlm convergence sweep (docs/results.md, "CharGPT 1.26 M"), run as two
# processes of one thread each (the machine has two cores). Every stage is
# resumable: run the script again and finished runs are skipped.
#
#   scripts/charlm_sweep.sh tune  "glion,gadamw" "dlion_mavo,powersgd_adamw:4"   # lr grid at N=4, seed 0
#   scripts/charlm_sweep.sh sweep "glion,gadamw" "dlion_mavo,powersgd_adamw:4" 4 0,1,2
#   scripts/charlm_sweep.sh plot
#
# Other shards (the diagnostic runs, other N) are plain `dlion experiment --task charlm ...
# --config $OUT/tuned.json --out $OUT/shards/diag_*|N*` commands; `plot` merges them too.
#
# Each shard writes its own directory under $OUT/shards; `tune` merges the shards'
# tuned.json into $OUT/tuned.json, `sweep` and `plot` merge their runs into $OUT/runs.jsonl.
set -euo pipefail
OUT=${OUT:-docs/results/charlm}
PY=${PYTHON:-python}
stage=${1:?usage: $0 tune|sweep|plot ...}
mkdir -p "$OUT/shards"

case "$stage" in
tune)
    shift
    i=0
    for methods in "$@"; do
        $PY -m dlion experiment --task charlm --tune --workers 4 --seeds 0 --methods "$methods" \
            --out "$OUT/shards/tune$i" --quiet &
        i=$((i + 1))
    done
    wait
    $PY - "$OUT" <<'EOF'
import glob, json, os, sys
out = sys.argv[1]
path = os.path.join(out, "tuned.json")
merged = json.load(open(path)) if os.path.exists(path) else None
for f in sorted(glob.glob(os.path.join(out, "shards", "tune*", "tuned.json"))):
    c = json.load(open(f))
    if merged is None:
        merged = c
    else:
        merged["methods"].update(c["methods"])
json.dump(merged, open(path, "w"), indent=1)
for m, c in merged["methods"].items():
    print(f"{m:20s} lr={c['lr']:g} score={c['score']:.4f}")
EOF
    ;;
sweep)
    workers=${4:?workers}
    seeds=${5:?seeds}
    name=$(echo "N${workers}_s${seeds}" | tr ',' '-')
    $PY -m dlion experiment --task charlm --methods "$2" --workers "$workers" --seeds "$seeds" \
        --config "$OUT/tuned.json" --out "$OUT/shards/${name}_a" --resume --quiet > /dev/null &
    $PY -m dlion experiment --task charlm --methods "$3" --workers "$workers" --seeds "$seeds" \
        --config "$OUT/tuned.json" --out "$OUT/shards/${name}_b" --resume --quiet > /dev/null &
    wait
    ;;
plot)
    shards=$(ls -d "$OUT"/shards/N* "$OUT"/shards/diag* 2>/dev/null || true)
    # shellcheck disable=SC2086
    $PY -m dlion experiment --task charlm --plot-only --config "$OUT/tuned.json" --out "$OUT" \
        --fig-dir docs/figures --fig-name results_charlm ${shards:+--merge $shards}
    ;;
*)
    echo "unknown stage $stage" >&2
    exit 2
    ;;
esac
