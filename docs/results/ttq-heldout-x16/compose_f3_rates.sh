#!/usr/bin/env bash
set -e
# The held-out rule's part 12 (docs/results/ttq-heldout/rule_part12.txt): part 7's streamed setting (H = 25,
# 3 fragments, momenta reset where each vote is applied) timed at all three rates on both emulated hosts, its
# evaluation seeds' curves composed with those runs and moved onto the others' compute-only step beside every
# other row (peers and our own), targets 2.1 and 2.2, into seeds-avg-st-h25-f3-rates/rebased.json. Run from
# anywhere, after
#   dlion bench e2e --link 3125kbit,6250kbit,62500kbit --queue 800ms --ties random --methods compute,d-local-avg,d-local-avg-st \
#       --sync-every 25 --outer-scale 0.83 --reset-momentum --fragments 3 --bucket-mb 1.5 --steps 100 --warmup 3 --fused \
#       --no-progress --out docs/results/e2e-local-x16-avg-st-h25-f3-rates
#   (the 4x host: --link 12500kbit,25mbit,250mbit --queue 200ms ... --out docs/results/e2e-local-x4-avg-st-h25-f3-rates)
#
# LR (default 3e-4) picks the curves' lr; another lr writes its rows under names ending -lrLR. ROW_NAMES replaces the
# rows it is moved beside, and PEERS, where given, also writes rebased-vs-peers.json beside those rows alone (rule part
# 16 at 4e-4: compose_f3_rates_lr4e-4.sh).
cd "$(dirname "$0")/../../.."
P=${PYTHON:-python}
LR=${LR:-3e-4}
SUF=$([ "$LR" = 3e-4 ] || echo "-lr$LR")
RUNS=docs/results/ttq-heldout/dlocal-avg-st-h25-f3-a0.83-reset-applied-w0.1-lr$LR-seed
. docs/results/ttq-heldout-x16/compose_common.sh
for HOST in ${HOSTS:-x16 x4}; do
host $HOST; OWN=docs/results/e2e-local-$HOST-avg-st-h25-f3-rates/e2e_results.json
for T in 2.1 2.2; do
  target $HOST $T
  compose_seeds $RUNS $OWN $T dlocal-avg-st-h25-f3-rates$SUF avg-st-h25-f3-rates$SUF
  rows() { R=""; for NAME in "$@"; do [ -f $O/seeds-$NAME/rebased.json ] && R="$R $O/seeds-$NAME/rebased.json"; done; echo $R; }
  for VS in rebased ${PEERS:+rebased-vs-peers}; do
    if [ $VS = rebased ]; then ROWS=$(rows ${ROW_NAMES:-diloco-bf16-h100 diloco-bf16-h100-olr1.0 diloco-bf16-h50 avg-h32-reset \
                                          avg-h32-reset-lr6e-4 avg-h25-reset avg-h50-reset avg-st-h25-d11 avg-st-h25-d3 avg-st-h25-f3-ra})
    else ROWS=$(rows $PEERS); fi   # each: rows already moved onto the others' compute-only step, for this host and target
    $P scripts/ttq_rebase_compute.py --steps-json $O/seeds-avg-st-h25-f3-rates$SUF/ttq_seeds.json \
        --method "d-local-avg-st|fragments=3|reset_momentum" --e2e-method d-local-avg-st --own $OWN --ref $REF --speedup $S \
        --raw-links $LINKS --others $OTHERS --rebased-others $ROWS --out $O/seeds-avg-st-h25-f3-rates$SUF/$VS.json > /dev/null
  done
done
done
