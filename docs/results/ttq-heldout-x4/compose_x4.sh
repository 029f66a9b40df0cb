#!/usr/bin/env bash
set -e
# the 4x host's time-to-quality compositions (docs/benchmarks.md); run from anywhere
cd "$(dirname "$0")/../../.."
P=${PYTHON:-python}
# the step times (root: the virtual cluster; 5 and 7 min), run before this script:
#   dlion bench e2e --link 12500kbit,25mbit,250mbit --queue 200ms --ties random --methods compute,d-local-avg --sync-every 32 \
#       --outer-scale 0.83 --reset-momentum --steps 128 --warmup 3 --bucket-mb 6 --fused --no-progress --out docs/results/e2e-local-x4-avg-h32
#   dlion bench e2e --link 12500kbit,25mbit,250mbit --queue 200ms --ties random --methods compute,diloco-adamw-bf16 --sync-every 100 \
#       --steps 200 --warmup 3 --bucket-mb 6 --fused --no-progress --out docs/results/e2e-local-x4-h100
X4=docs/results/e2e-faster-host-x4/e2e_results.json
for T in 2.1 2.2; do
  O=docs/results/ttq-heldout-x4; [ $T = 2.2 ] && O=docs/results/ttq-heldout-x4-target2.2
  for K in 0 1 2 3 4; do
    $P -m dlion bench ttq --curves docs/results/ttq-heldout/psgd4-w0.1-seed$K/ttq_results.json --step-times $X4 \
        --target $T --compute-speedup 4 --borrow-curve g-adamw-powersgd4-ov=g-adamw-powersgd4 --out $O/psgd4-w0.1-seed$K > /dev/null
    $P -m dlion bench ttq --curves docs/results/ttq-wordcoin-dlion-seed$K/ttq_results.json --step-times $X4 \
        --target $T --compute-speedup 4 --out $O/dlion-seed$K > /dev/null
    $P -m dlion bench ttq --curves docs/results/ttq-heldout/dlocal-avg-h32-a0.83-reset-lr3e-4-seed$K/ttq_results.json \
        --step-times docs/results/e2e-local-x4-avg-h32/e2e_results.json --target $T --compute-speedup 4 --out $O/dlocal-avg-h32-reset-seed$K > /dev/null
    $P -m dlion bench ttq --curves docs/results/ttq-heldout/diloco-bf16-h100-lr1e-4-seed$K/ttq_results.json \
        --step-times docs/results/e2e-local-x4-h100/e2e_results.json --target $T --compute-speedup 4 --out $O/diloco-bf16-h100-lr1e-4-seed$K > /dev/null
  done
  $P -m dlion bench ttq --across $O/dlion-seed{0,1,2,3,4}/ttq_results.json $O/psgd4-w0.1-seed{0,1,2,3,4}/ttq_results.json --out $O/seeds-w0.1 > /dev/null
  $P -m dlion bench ttq --across $O/dlocal-avg-h32-reset-seed{0,1,2,3,4}/ttq_results.json --out $O/seeds-avg-h32-reset > /dev/null
  $P -m dlion bench ttq --across $O/diloco-bf16-h100-lr1e-4-seed{0,1,2,3,4}/ttq_results.json --out $O/seeds-diloco-bf16-h100 > /dev/null
  R="--ref $X4 --speedup 4 --raw-links 12500kbit,25mbit,250mbit"
  $P scripts/ttq_rebase_compute.py --steps-json $O/seeds-diloco-bf16-h100/ttq_seeds.json --method diloco-adamw-bf16 \
      --e2e-method diloco-adamw-bf16 --own docs/results/e2e-local-x4-h100/e2e_results.json $R \
      --others $O/seeds-w0.1/ttq_seeds.json --out $O/seeds-diloco-bf16-h100/rebased.json
  $P scripts/ttq_rebase_compute.py --steps-json $O/seeds-avg-h32-reset/ttq_seeds.json --method "d-local-avg|reset_momentum" \
      --own docs/results/e2e-local-x4-avg-h32/e2e_results.json $R \
      --others $O/seeds-w0.1/ttq_seeds.json --rebased-others $O/seeds-diloco-bf16-h100/rebased.json --out $O/seeds-avg-h32-reset/rebased.json
done
