#!/usr/bin/env bash
set -e
# The held-out rule's part 13 (docs/results/ttq-heldout/rule_part13.txt): Streaming DiLoCo (AdamW bf16, H = 100, lr 1e-4,
# outer lr 1.0, the exchange started tau = 5 steps before each round ends, alpha 0.5) timed at 1 Gbit/s on both emulated
# hosts, its evaluation seeds composed and moved onto the others' compute-only step beside every row, targets 2.1 and
# 2.2, into seeds-diloco-bf16-st-h100/rebased.json; then the vote's streamed 3-fragment row (part 12) and the defaults
# beside it, into rebased-vs-diloco-st.json. Run from anywhere, after
#   dlion bench e2e --link 62500kbit --queue 800ms --ties random --methods compute,diloco-adamw-bf16,diloco-adamw-bf16-st \
#       --sync-every 100 --stream-delay 5 --fragment-alpha 0.5 --outer-lr 1.0 --steps 200 --warmup 3 --fused --no-progress \
#       --out docs/results/e2e-local-x16-st-h100
#   (the 4x host: --link 250mbit --queue 200ms --bucket-mb 6 ... --out docs/results/e2e-local-x4-st-h100)
#   dlion bench ttq $R --methods diloco-adamw-bf16-st --sync-every 100 --stream-delay 5 --fragment-alpha 0.5 --outer-lr 1.0 \
#       --lr 1e-4 --seed K --out docs/results/ttq-heldout/diloco-bf16-st-h100-d5-a0.5-olr1.0-lr1e-4-seedK   # K = 0-4
cd "$(dirname "$0")/../../.."
P=${PYTHON:-python}
RUNS=docs/results/ttq-heldout/diloco-bf16-st-h100-d5-a0.5-olr1.0-lr1e-4-seed
. docs/results/ttq-heldout-x16/compose_common.sh
for HOST in ${HOSTS:-x16 x4}; do
host $HOST; OWN=docs/results/e2e-local-$HOST-st-h100/e2e_results.json
for T in 2.1 2.2; do
  target $HOST $T
  compose_seeds $RUNS $OWN $T diloco-bf16-st-h100
  ROWS=""   # every row already moved onto the others' compute-only step, for this host and target
  for NAME in diloco-bf16-h100 diloco-bf16-h100-olr1.0 diloco-bf16-h50 avg-h32-reset avg-h32-reset-lr6e-4 avg-h25-reset \
              avg-h50-reset avg-st-h25-d11 avg-st-h25-d3 avg-st-h25-f3-ra avg-st-h25-f3-rates; do
    [ -f $O/seeds-$NAME/rebased.json ] && ROWS="$ROWS $O/seeds-$NAME/rebased.json"
  done
  D=$O/seeds-diloco-bf16-st-h100/rebased.json
  $P scripts/ttq_rebase_compute.py --steps-json $O/seeds-diloco-bf16-st-h100/ttq_seeds.json \
      --method "diloco-adamw-bf16-st|stream_delay=5|fragment_alpha=0.5" --e2e-method diloco-adamw-bf16-st --own $OWN --ref $REF \
      --speedup $S --raw-links $LINKS --links 1gbit --others $OTHERS --rebased-others $ROWS --out $D > /dev/null
  $P scripts/ttq_rebase_compute.py --inputs-from $O/seeds-avg-st-h25-f3-rates/rebased.json --rebased-others $D \
      --out $O/seeds-avg-st-h25-f3-rates/rebased-vs-diloco-st.json > /dev/null
  $P scripts/ttq_rebase_compute.py --inputs-from $O/seeds-avg-h32-reset/rebased-vs-diloco-h50.json --rebased-others $D \
      --out $O/seeds-avg-h32-reset/rebased-vs-diloco-st.json > /dev/null
done
done
