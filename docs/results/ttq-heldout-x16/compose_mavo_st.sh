#!/usr/bin/env bash
set -e
# The held-out rule's part 18 (docs/results/ttq-heldout/rule_part18.txt): the majority vote streamed in two fragments
# (outer scale 0.67, momenta reset where each vote is applied, 10 % warm-up, --bucket-mb 1.5), H from step A's timing,
# lr from the seed-100 ladder, its evaluation seeds composed with step A's e2e run and moved onto the others' compute-only
# step beside every row of the 16x tables, targets 2.1 and 2.2, into seeds-mavo-st-hH-f2/rebased.json (beside every row)
# and rebased-vs-peers.json (beside the peers alone: DiLoCo in every form and the every-step methods). Run from anywhere,
# after the other compose_*.sh scripts (whose outputs this one reads) and
#   dlion bench e2e --link 3125kbit,6250kbit,62500kbit --queue 800ms --ties random \
#       --methods compute,d-local-mavo-st-h16,d-local-mavo-st-h20,d-local-mavo-st-h24 --outer-scale 0.67 --reset-momentum \
#       --fragments 2 --bucket-mb 1.5 --steps 240 --warmup 3 --fused --no-progress --out docs/results/e2e-local-x16-mavo-st-f2
#   dlion bench ttq $R --bucket-mb 1.5 --warmup-frac 0.1 --methods d-local-mavo-st --sync-every H --fragments 2 --ties random \
#       --outer-scale 0.67 --reset-momentum --lr LR --seed K \
#       --out docs/results/ttq-heldout/dlocal-mavo-st-hH-f2-a0.67-reset-w0.1-lrLR-seedK
#   (the 4x host: --link 12500kbit,25mbit,250mbit --queue 200ms --methods compute,d-local-mavo-st-h16 ...
#    --out docs/results/e2e-local-x4-mavo-st-f2; HOSTS="x16 x4")
# H, LR: the rule's picks; SEEDS: the evaluation seeds run (default 0-4); HOSTS (default x16).
cd "$(dirname "$0")/../../.."
P=${PYTHON:-python}
H=${H:?the rule part 18 H}; LR=${LR:?the rule part 18 lr}
RUNS=docs/results/ttq-heldout/dlocal-mavo-st-h$H-f2-a0.67-reset-w0.1-lr$LR-seed
NAME=mavo-st-h$H-f2
. docs/results/ttq-heldout-x16/compose_common.sh
# every row of either host's tables (a host lacking one skips it)
PEERS="diloco-bf16-h100 diloco-bf16-h100-olr1.0 diloco-bf16-h50 diloco-bf16-st-h100 diloco-bf16-st-h50 diloco-fp4-st-h100
       diloco-fp4-st-h100-d35 diloco-fp4-h100 diloco-fp4-st-h50-d5 diloco-fp4-st-h50-d36 diloco-fp4-h50 diloco-fp4-st-h100-d18
       diloco-fp4-st-h100-d9 diloco-fp4-st-h50-d11 diloco-fp4-st-h50-d20"
OURS="avg-h32-reset avg-h32-reset-lr6e-4 avg-h25-reset avg-h50-reset avg-st-h25-d11 avg-st-h25-d3 avg-st-h25-f3-rates-lr4e-4
      avg-h16-reset avg-h16-reset-slow"
rows() { R=""; for N in "$@"; do [ -f $O/seeds-$N/rebased.json ] && R="$R $O/seeds-$N/rebased.json"; done; echo $R; }
for HOST in ${HOSTS:-x16}; do
host $HOST; OWN=docs/results/e2e-local-$HOST-mavo-st-f2/e2e_results.json
for T in 2.1 2.2; do
  target $HOST $T
  compose_seeds $RUNS $OWN $T $NAME
  for VS in rebased rebased-vs-peers; do
    if [ $VS = rebased ]; then ROWS=$(rows $PEERS $OURS); else ROWS=$(rows $PEERS); fi
    $P scripts/ttq_rebase_compute.py --steps-json $O/seeds-$NAME/ttq_seeds.json --method "${METHOD:-d-local-mavo-st|fragments=2|reset_momentum}" \
        --e2e-method d-local-mavo-st-h$H --own $OWN --ref $REF --speedup $S --raw-links $LINKS --others $OTHERS \
        --rebased-others $ROWS --out $O/seeds-$NAME/$VS.json
  done
done
done
