#!/usr/bin/env bash
set -e
# The held-out rule's part 16 (docs/results/ttq-heldout/rule_part16.txt): the 3-fragment setting of part 12 at lr 4e-4,
# the seed-100 pick, its evaluation seeds 0-4 composed with part 12's e2e runs (the lr changes neither the compute nor
# the bytes of a step) and moved onto the others' compute-only step beside every other row, targets 2.1 and 2.2, into
# seeds-avg-st-h25-f3-rates-lr4e-4/rebased.json. Run from anywhere, after compose_f3_rates.sh, compose_short_h16.sh
# (whose outputs this one reads) and
#   dlion bench ttq $R --bucket-mb 1.5 --warmup-frac 0.1 --methods d-local-avg-st --sync-every 25 --fragments 3 --ties random \
#       --outer-scale 0.83 --reset-momentum --lr 4e-4 --seed K \
#       --out docs/results/ttq-heldout/dlocal-avg-st-h25-f3-a0.83-reset-applied-w0.1-lr4e-4-seedK   # K = 0-4
# and part 12's e2e runs:
#   dlion bench e2e --link 3125kbit,6250kbit,62500kbit --queue 800ms --ties random --methods compute,d-local-avg,d-local-avg-st \
#       --sync-every 25 --outer-scale 0.83 --reset-momentum --fragments 3 --bucket-mb 1.5 --steps 100 --warmup 3 --fused \
#       --no-progress --out docs/results/e2e-local-x16-avg-st-h25-f3-rates
#   (the 4x host: --link 12500kbit,25mbit,250mbit --queue 200ms ... --out docs/results/e2e-local-x4-avg-st-h25-f3-rates)
cd "$(dirname "$0")/../../.."
P=${PYTHON:-python}
RUNS=docs/results/ttq-heldout/dlocal-avg-st-h25-f3-a0.83-reset-applied-w0.1-lr4e-4-seed
. docs/results/ttq-heldout-x16/compose_common.sh
for HOST in ${HOSTS:-x16 x4}; do
host $HOST; OWN=docs/results/e2e-local-$HOST-avg-st-h25-f3-rates/e2e_results.json
for T in 2.1 2.2; do
  target $HOST $T
  compose_seeds $RUNS $OWN $T dlocal-avg-st-h25-f3-rates-lr4e-4 avg-st-h25-f3-rates-lr4e-4
  ROWS=""   # every row already moved onto the others' compute-only step, for this host and target
  for NAME in diloco-bf16-h100 diloco-bf16-h100-olr1.0 diloco-bf16-h50 avg-h32-reset avg-h32-reset-lr6e-4 avg-h25-reset \
              avg-h50-reset avg-st-h25-d11 avg-st-h25-d3 avg-st-h25-f3-ra avg-st-h25-f3-rates avg-h16-reset; do
    [ -f $O/seeds-$NAME/rebased.json ] && ROWS="$ROWS $O/seeds-$NAME/rebased.json"
  done
  $P scripts/ttq_rebase_compute.py --steps-json $O/seeds-avg-st-h25-f3-rates-lr4e-4/ttq_seeds.json \
      --method "d-local-avg-st|fragments=3|reset_momentum" --e2e-method d-local-avg-st --own $OWN --ref $REF --speedup $S \
      --raw-links $LINKS --others $OTHERS --rebased-others $ROWS --out $O/seeds-avg-st-h25-f3-rates-lr4e-4/rebased.json > /dev/null
done
done
