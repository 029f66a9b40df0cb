#!/usr/bin/env bash
set -e
# The held-out rule's part 16 (docs/results/ttq-heldout/rule_part16.txt): the 3-fragment setting of part 12 at lr 4e-4,
# the seed-100 pick, its evaluation seeds 0-4 composed with part 12's e2e runs (the lr changes neither the compute nor
# the bytes of a step) and moved onto the others' compute-only step, targets 2.1 and 2.2 (compose_f3_rates.sh at
# LR=4e-4): into seeds-avg-st-h25-f3-rates-lr4e-4/rebased.json beside every row of the tables (the same setting at 3e-4,
# which this row replaces, left out), and into rebased-vs-peers.json beside the peers alone (DiLoCo in every form,
# streamed or not, and the every-step methods). Run from anywhere, after the other compose_*.sh scripts (whose outputs
# this one reads; compose_short_h16.sh reads this one's, and the times it reads do not depend on it) and
#   dlion bench ttq $R --bucket-mb 1.5 --warmup-frac 0.1 --methods d-local-avg-st --sync-every 25 --fragments 3 --ties random \
#       --outer-scale 0.83 --reset-momentum --lr 4e-4 --seed K \
#       --out docs/results/ttq-heldout/dlocal-avg-st-h25-f3-a0.83-reset-applied-w0.1-lr4e-4-seedK   # K = 0-4
# and part 12's e2e runs:
#   dlion bench e2e --link 3125kbit,6250kbit,62500kbit --queue 800ms --ties random --methods compute,d-local-avg,d-local-avg-st \
#       --sync-every 25 --outer-scale 0.83 --reset-momentum --fragments 3 --bucket-mb 1.5 --steps 100 --warmup 3 --fused \
#       --no-progress --out docs/results/e2e-local-x16-avg-st-h25-f3-rates
#   (the 4x host: --link 12500kbit,25mbit,250mbit --queue 200ms ... --out docs/results/e2e-local-x4-avg-st-h25-f3-rates)
DILOCO="diloco-bf16-h100 diloco-bf16-h100-olr1.0 diloco-bf16-h50 diloco-bf16-st-h100 diloco-bf16-st-h50"
LR=4e-4 PEERS="$DILOCO" ROW_NAMES="$DILOCO avg-h32-reset avg-h32-reset-lr6e-4 avg-h25-reset avg-h50-reset avg-st-h25-d11 \
  avg-st-h25-d3 avg-h16-reset avg-h16-reset-slow" exec bash "$(dirname "$0")/compose_f3_rates.sh"
