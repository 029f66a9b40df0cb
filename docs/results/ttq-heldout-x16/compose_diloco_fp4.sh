#!/usr/bin/env bash
set -e
# The held-out rule's part 17, stage 2 (docs/results/ttq-heldout/rule_part17.txt): Streaming DiLoCo with the 4-bit all-reduce
# (AdamW, H = 100, lr 1e-4, outer lr 1.0, alpha 0.5), each exchange started tau steps before its round ends: tau = 75 timed at
# 50 Mbit/s, tau = 35 at 100 Mbit/s, on the emulated 16x host; its evaluation seeds composed and moved onto the others'
# compute-only step beside every row, targets 2.1 and 2.2, into seeds-diloco-fp4-st-h100[-d35]/rebased.json; then the 3-fragment
# vote (lr 4e-4, the tables' row) beside them, into that row's rebased-vs-diloco-fp4.json and rebased-vs-peers-fp4.json.
# Run from anywhere (SETTINGS="75" or "35" for one), after the other compose_*.sh scripts (whose outputs this one reads) and
#   dlion bench e2e --link 3125kbit --queue 800ms --ties random --methods compute,diloco-adamw-fp4-st-h100 --stream-delay 75 \
#       --fragment-alpha 0.5 --outer-lr 1.0 --steps 200 --warmup 3 --fused --no-progress --out docs/results/e2e-local-x16-fp4-st
#   (tau = 35: --link 6250kbit --stream-delay 35 ... --out docs/results/e2e-local-x16-fp4-st-100mbit)
#   dlion bench ttq $R --methods diloco-adamw-fp4-st --sync-every 100 --stream-delay TAU --fragment-alpha 0.5 --outer-lr 1.0 \
#       --lr 1e-4 --seed K --out docs/results/ttq-heldout/diloco-fp4-st-h100-dTAU-a0.5-olr1.0-lr1e-4-seedK   # K = 0-4
cd "$(dirname "$0")/../../.."
P=${PYTHON:-python}
. docs/results/ttq-heldout-x16/compose_common.sh
host x16
for T in 2.1 2.2; do
  target x16 $T
  ROWS=""   # every row already moved onto the others' compute-only step, for this target
  for NAME in diloco-bf16-h100 diloco-bf16-h100-olr1.0 diloco-bf16-h50 diloco-bf16-st-h100 avg-h32-reset avg-h32-reset-lr6e-4 \
              avg-h25-reset avg-h50-reset avg-st-h25-d11 avg-st-h25-d3 avg-st-h25-f3-rates-lr4e-4 avg-h16-reset avg-h16-reset-slow; do
    [ -f $O/seeds-$NAME/rebased.json ] && ROWS="$ROWS $O/seeds-$NAME/rebased.json"
  done
  MINE=""
  for TAU in ${SETTINGS:-75 35}; do
    if [ $TAU = 75 ]; then NAME=diloco-fp4-st-h100; OWN=docs/results/e2e-local-x16-fp4-st/e2e_results.json; LINK=50mbit
    else NAME=diloco-fp4-st-h100-d$TAU; OWN=docs/results/e2e-local-x16-fp4-st-100mbit/e2e_results.json; LINK=100mbit; fi
    compose_seeds docs/results/ttq-heldout/diloco-fp4-st-h100-d$TAU-a0.5-olr1.0-lr1e-4-seed $OWN $T $NAME
    D=$O/seeds-$NAME/rebased.json
    $P scripts/ttq_rebase_compute.py --steps-json $O/seeds-$NAME/ttq_seeds.json \
        --method "diloco-adamw-fp4-st|stream_delay=$TAU|fragment_alpha=0.5" --e2e-method diloco-adamw-fp4-st-h100 --own $OWN \
        --ref $REF --speedup $S --raw-links $LINKS --links $LINK --others $OTHERS --rebased-others $ROWS --out $D > /dev/null
    MINE="$MINE $D"
  done
  F=$O/seeds-avg-st-h25-f3-rates-lr4e-4
  $P scripts/ttq_rebase_compute.py --inputs-from $F/rebased.json --rebased-others $MINE --out $F/rebased-vs-diloco-fp4.json > /dev/null
  $P scripts/ttq_rebase_compute.py --inputs-from $F/rebased-vs-peers.json --rebased-others $MINE \
      --out $F/rebased-vs-peers-fp4.json > /dev/null
done
