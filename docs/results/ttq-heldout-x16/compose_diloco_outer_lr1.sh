#!/usr/bin/env bash
set -e
# DiLoCo AdamW bf16 at H = 100, lr 1e-4, at the outer lr 1.0 the held-out rule's part 10 chose on seed 100
# (docs/results/ttq-heldout/rule_part10.txt), composed like the outer lr 0.7 rows (docs/benchmarks.md, ᵃ) on
# the emulated 16x and 4x hosts, targets 2.1 and 2.2; then the local votes' rows moved onto the others'
# compute-only step again, now beside it. Run from anywhere, after the five runs
#   dlion bench ttq $R --methods diloco-adamw-bf16 --sync-every 100 --outer-lr 1.0 --lr 1e-4 --seed K \
#       --out docs/results/ttq-heldout/diloco-bf16-h100-olr1.0-lr1e-4-seedK   # K = 0-4
cd "$(dirname "$0")/../../.."
P=${PYTHON:-python}
RUNS=docs/results/ttq-heldout/diloco-bf16-h100-olr1.0-lr1e-4-seed
. docs/results/ttq-heldout-x16/compose_common.sh
for HOST in x16 x4; do
  host $HOST; OWN=docs/results/e2e-local-$HOST-h100/e2e_results.json
  for T in 2.1 2.2; do
    target $HOST $T
    compose_seeds $RUNS $OWN $T diloco-bf16-h100-olr1.0
    # (OTHERS: the others as the outer lr 0.7 row was compared with them)
    D=$O/seeds-diloco-bf16-h100-olr1.0/rebased.json
    $P scripts/ttq_rebase_compute.py --steps-json $O/seeds-diloco-bf16-h100-olr1.0/ttq_seeds.json \
        --method diloco-adamw-bf16 --e2e-method diloco-adamw-bf16 --own $OWN --ref $REF --speedup $S --raw-links $LINKS \
        --others $OTHERS --out $D > /dev/null
    # the local votes' rows again, each with its rebased.json's own inputs and this DiLoCo row added to the
    # others (into rebased-vs-diloco-olr1.0.json beside it)
    for NAME in avg-h32-reset avg-h32-reset-lr6e-4 avg-h25-reset avg-h50-reset avg-st-h25-f3-ra avg-st-h25-d11 avg-st-h25-d3; do
      F=$O/seeds-$NAME/rebased.json; [ -f $F ] || continue   # (not composed for this host or target)
      $P scripts/ttq_rebase_compute.py --inputs-from $F --rebased-others $D --raw-links $LINKS \
          --out $O/seeds-$NAME/rebased-vs-diloco-olr1.0.json > /dev/null
    done
  done
done
