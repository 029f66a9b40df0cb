#!/usr/bin/env bash
set -e
# DiLoCo AdamW bf16 at H = 50 at the lrs the held-out rule's part 11 chose on seed 100 (inner LR, outer OLR:
# docs/results/ttq-heldout/rule_part11.txt), composed with its own e2e runs on the emulated 16x and 4x hosts
# (e2e-local-x16-h50, e2e-local-x4-h50), targets 2.1 and 2.2, moved onto the others' compute-only step like
# the H = 100 rows; then the local votes' rows again beside all three DiLoCo rows (H = 100 at outer lr 0.7
# and 1.0, H = 50), into rebased-vs-diloco-h50.json beside each row's rebased.json. Run from anywhere, after
#   dlion bench e2e --link 3125kbit,6250kbit,62500kbit --queue 800ms --ties random --methods compute,diloco-adamw-bf16 \
#       --sync-every 50 --steps 200 --warmup 3 --fused --no-progress --out docs/results/e2e-local-x16-h50
#   (the 4x host: --link 12500kbit,25mbit,250mbit --queue 200ms --bucket-mb 6 ... --out docs/results/e2e-local-x4-h50)
#   dlion bench ttq $R --methods diloco-adamw-bf16 --sync-every 50 --outer-lr OLR --lr LR --seed K \
#       --out docs/results/ttq-heldout/diloco-bf16-h50-olrOLR-lrLR-seedK   # K = 0-4
cd "$(dirname "$0")/../../.."
P=${PYTHON:-python}
LR=${LR:?the chosen inner lr}; OLR=${OLR:?the chosen outer lr}
RUNS=docs/results/ttq-heldout/diloco-bf16-h50-olr$OLR-lr$LR-seed
. docs/results/ttq-heldout-x16/compose_common.sh
for HOST in x16 x4; do
host $HOST; OWN=docs/results/e2e-local-$HOST-h50/e2e_results.json
for T in 2.1 2.2; do
  target $HOST $T
  compose_seeds $RUNS $OWN $T diloco-bf16-h50
  D=$O/seeds-diloco-bf16-h50/rebased.json
  $P scripts/ttq_rebase_compute.py --steps-json $O/seeds-diloco-bf16-h50/ttq_seeds.json \
      --method diloco-adamw-bf16 --e2e-method diloco-adamw-bf16 --own $OWN --ref $REF --speedup $S --raw-links $LINKS \
      --others $OTHERS \
      --rebased-others $O/seeds-diloco-bf16-h100/rebased.json $O/seeds-diloco-bf16-h100-olr1.0/rebased.json --out $D > /dev/null
  for NAME in avg-h32-reset avg-h32-reset-lr6e-4 avg-h25-reset avg-h50-reset avg-st-h25-f3-ra avg-st-h25-d11 avg-st-h25-d3; do
    F=$O/seeds-$NAME/rebased-vs-diloco-olr1.0.json; [ -f $F ] || continue   # (not composed for this target)
    $P scripts/ttq_rebase_compute.py --inputs-from $F --rebased-others $D --raw-links $LINKS \
        --out $O/seeds-$NAME/rebased-vs-diloco-h50.json > /dev/null
  done
done
done
