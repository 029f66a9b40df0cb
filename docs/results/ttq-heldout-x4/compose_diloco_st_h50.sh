#!/usr/bin/env bash
set -e
# The held-out rule's part 14 (docs/results/ttq-heldout/rule_part14.txt): Streaming DiLoCo every 50 steps (AdamW bf16,
# lr 2e-4, outer lr 0.7, tau = 3, alpha 0.5) on the emulated 4x host at 1 Gbit/s, its evaluation seeds composed and moved
# onto the others' compute-only step beside every row, targets 2.1 and 2.2, into seeds-diloco-bf16-st-h50/rebased.json;
# then the 3-fragment vote and the defaults beside it, into rebased-vs-diloco-st-h50.json. Run from anywhere, after
#   dlion bench e2e --link 250mbit --queue 200ms --ties random --methods compute,diloco-adamw-bf16,diloco-adamw-bf16-st \
#       --sync-every 50 --stream-delay 3 --fragment-alpha 0.5 --outer-lr 0.7 --steps 200 --warmup 3 --bucket-mb 6 --fused \
#       --no-progress --out docs/results/e2e-local-x4-st-h50
#   dlion bench ttq $R --methods diloco-adamw-bf16-st --sync-every 50 --stream-delay 3 --fragment-alpha 0.5 --outer-lr 0.7 \
#       --lr 2e-4 --seed K --out docs/results/ttq-heldout/diloco-bf16-st-h50-d3-a0.5-olr0.7-lr2e-4-seedK   # K = 0-4
# and docs/results/ttq-heldout-x16/compose_diloco_st.sh (whose outputs this one adds to).
cd "$(dirname "$0")/../../.."
P=${PYTHON:-python}
RUNS=docs/results/ttq-heldout/diloco-bf16-st-h50-d3-a0.5-olr0.7-lr2e-4-seed
OWN=docs/results/e2e-local-x4-st-h50/e2e_results.json
. docs/results/ttq-heldout-x16/compose_common.sh
host x4
for T in 2.1 2.2; do
  target x4 $T
  compose_seeds $RUNS $OWN $T diloco-bf16-st-h50
  ROWS=""
  for NAME in diloco-bf16-h100 diloco-bf16-h100-olr1.0 diloco-bf16-h50 diloco-bf16-st-h100 avg-h32-reset avg-h32-reset-lr6e-4 \
              avg-st-h25-f3-rates; do
    [ -f $O/seeds-$NAME/rebased.json ] && ROWS="$ROWS $O/seeds-$NAME/rebased.json"
  done
  D=$O/seeds-diloco-bf16-st-h50/rebased.json
  $P scripts/ttq_rebase_compute.py --steps-json $O/seeds-diloco-bf16-st-h50/ttq_seeds.json \
      --method "diloco-adamw-bf16-st|stream_delay=3|fragment_alpha=0.5" --e2e-method diloco-adamw-bf16-st --own $OWN \
      --ref $REF --speedup $S --raw-links $LINKS --links 1gbit --others $OTHERS --rebased-others $ROWS --out $D > /dev/null
  for NAME in avg-st-h25-f3-rates avg-h32-reset; do
    $P scripts/ttq_rebase_compute.py --inputs-from $O/seeds-$NAME/rebased-vs-diloco-st.json --rebased-others $D \
        --out $O/seeds-$NAME/rebased-vs-diloco-st-h50.json > /dev/null
  done
done
