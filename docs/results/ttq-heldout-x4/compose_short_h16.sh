#!/usr/bin/env bash
set -e
# The held-out rule's part 15 (docs/results/ttq-heldout/rule_part15.txt): the vote every 16 steps (signs averaged, outer
# scale 0.83, momenta reset, 10 % warm-up, lr 6e-4 from the seed-100 ladder) at 1 Gbit/s on the emulated 4x and 16x
# hosts, its evaluation seeds composed and moved onto the others' compute-only step beside every row of that host,
# targets 2.1 and 2.2, into seeds-avg-h16-reset/rebased.json; the addendum's 50 and 100 Mbit/s runs the same way into
# seeds-avg-h16-reset-slow/rebased.json. Run from anywhere, after
#   dlion bench e2e --link 250mbit --queue 200ms --ties random --methods compute,d-local-avg-h4,d-local-avg-h8,d-local-avg-h16 \
#       --outer-scale 0.83 --reset-momentum --bucket-mb 6 --steps 112 --warmup 3 --fused --no-progress \
#       --out docs/results/e2e-local-x4-avg-short
#   (the 16x host: --link 62500kbit --queue 800ms --methods compute,d-local-avg-h16 ... --out docs/results/e2e-local-x16-avg-short)
#   dlion bench e2e --link 12500kbit,25mbit --queue 200ms --ties random --methods compute,d-local-avg-h16 --outer-scale 0.83 \
#       --reset-momentum --bucket-mb 6 --steps 112 --warmup 3 --fused --no-progress --out docs/results/e2e-local-x4-avg-short-slow
#   (the 16x host: --link 3125kbit,6250kbit --queue 800ms ... --out docs/results/e2e-local-x16-avg-short-slow)
#   dlion bench ttq $R --warmup-frac 0.1 --methods d-local-avg --sync-every 16 --outer-scale 0.83 --reset-momentum --lr 6e-4 \
#       --seed K --out docs/results/ttq-heldout/dlocal-avg-h16-a0.83-reset-w0.1-lr6e-4-seedK   # K = 0-4
# and the other compose_*.sh scripts (whose outputs this one reads; the 3-fragment row at lr 4e-4, rule part 16).
cd "$(dirname "$0")/../../.."
P=${PYTHON:-python}
RUNS=docs/results/ttq-heldout/dlocal-avg-h16-a0.83-reset-w0.1-lr6e-4-seed
. docs/results/ttq-heldout-x16/compose_common.sh
for HOST in ${HOSTS:-x4 x16}; do
host $HOST
for T in 2.1 2.2; do
  target $HOST $T
  ROWS=""   # every row already moved onto the others' compute-only step, for this host and target
  for NAME in diloco-bf16-h100 diloco-bf16-h100-olr1.0 diloco-bf16-h50 diloco-bf16-st-h100 diloco-bf16-st-h50 avg-h32-reset \
              avg-h32-reset-lr6e-4 avg-h25-reset avg-h50-reset avg-st-h25-d11 avg-st-h25-d3 avg-st-h25-f3-rates-lr4e-4; do
    [ -f $O/seeds-$NAME/rebased.json ] && ROWS="$ROWS $O/seeds-$NAME/rebased.json"
  done
  for RATES in 1gbit "50mbit 100mbit"; do
    if [ "$RATES" = 1gbit ]; then NAME=avg-h16-reset; OWN=docs/results/e2e-local-$HOST-avg-short/e2e_results.json
    else NAME=avg-h16-reset-slow; OWN=docs/results/e2e-local-$HOST-avg-short-slow/e2e_results.json; fi
    compose_seeds $RUNS $OWN $T $NAME
    $P scripts/ttq_rebase_compute.py --steps-json $O/seeds-$NAME/ttq_seeds.json --method "d-local-avg|reset_momentum" \
        --e2e-method d-local-avg-h16 --own $OWN --ref $REF --speedup $S --raw-links $LINKS --links $RATES --others $OTHERS \
        --rebased-others $ROWS --out $O/seeds-$NAME/rebased.json > /dev/null
  done
done
done
