#!/usr/bin/env bash
set -e
# The held-out rule's part 16 (docs/results/ttq-heldout/rule_part16.txt): the 3-fragment setting of part 12 at lr 4e-4,
# the seed-100 pick, its evaluation seeds 0-4 composed with part 12's e2e runs (the lr changes neither the compute nor
# the bytes of a step) and moved onto the others' compute-only step beside every other row, targets 2.1 and 2.2, into
# seeds-avg-st-h25-f3-rates-lr4e-4/rebased.json (compose_f3_rates.sh at LR=4e-4). Run from anywhere, after compose_f3_rates.sh, compose_short_h16.sh
# (whose outputs this one reads) and
#   dlion bench ttq $R --bucket-mb 1.5 --warmup-frac 0.1 --methods d-local-avg-st --sync-every 25 --fragments 3 --ties random \
#       --outer-scale 0.83 --reset-momentum --lr 4e-4 --seed K \
#       --out docs/results/ttq-heldout/dlocal-avg-st-h25-f3-a0.83-reset-applied-w0.1-lr4e-4-seedK   # K = 0-4
# and part 12's e2e runs:
#   dlion bench e2e --link 3125kbit,6250kbit,62500kbit --queue 800ms --ties random --methods compute,d-local-avg,d-local-avg-st \
#       --sync-every 25 --outer-scale 0.83 --reset-momentum --fragments 3 --bucket-mb 1.5 --steps 100 --warmup 3 --fused \
#       --no-progress --out docs/results/e2e-local-x16-avg-st-h25-f3-rates
#   (the 4x host: --link 12500kbit,25mbit,250mbit --queue 200ms ... --out docs/results/e2e-local-x4-avg-st-h25-f3-rates)
LR=4e-4 EXTRA_ROWS="avg-st-h25-f3-rates avg-h16-reset" exec bash "$(dirname "$0")/compose_f3_rates.sh"
