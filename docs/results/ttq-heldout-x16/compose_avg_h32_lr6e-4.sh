#!/usr/bin/env bash
set -e
# The defaults (d-local-avg, H = 32, outer_scale 0.83, momenta reset) at lr 6e-4, the lr the held-out
# rule's part 9 chose on seed 100, composed like the lr 3e-4 rows (docs/benchmarks.md, ᵍ) on the
# emulated 16x and 4x hosts, targets 2.1 and 2.2. Run from anywhere, after the five runs
#   dlion bench ttq $R --methods d-local-avg --sync-every 32 --outer-scale 0.83 --reset-momentum --ties random \
#       --lr 6e-4 --seed K --out docs/results/ttq-heldout/dlocal-avg-h32-a0.83-reset-lr6e-4-seedK   # K = 0-4
cd "$(dirname "$0")/../../.."
P=${PYTHON:-python}
RUNS=docs/results/ttq-heldout/dlocal-avg-h32-a0.83-reset-lr6e-4-seed
for HOST in x16 x4; do
  if [ $HOST = x16 ]; then S=16; OWN=docs/results/e2e-local-x16-avg-h32/e2e_results.json; REF=docs/results/e2e-local-x16/e2e_results.json
       LINKS=3125kbit,6250kbit,62500kbit
  else S=4; OWN=docs/results/e2e-local-x4-avg-h32/e2e_results.json; REF=docs/results/e2e-faster-host-x4/e2e_results.json
       LINKS=12500kbit,25mbit,250mbit; fi
  for T in 2.1 2.2; do
    O=docs/results/ttq-heldout-$HOST; [ $T = 2.2 ] && O=docs/results/ttq-heldout-$HOST-target2.2
    for K in 0 1 2 3 4; do
      $P -m dlion bench ttq --curves $RUNS$K/ttq_results.json --step-times $OWN --target $T --compute-speedup $S \
          --out $O/dlocal-avg-h32-reset-lr6e-4-seed$K > /dev/null
    done
    $P -m dlion bench ttq --across $O/dlocal-avg-h32-reset-lr6e-4-seed{0,1,2,3,4}/ttq_results.json \
        --out $O/seeds-avg-h32-reset-lr6e-4 > /dev/null
    # the peers as the lr 3e-4 rows were compared with them
    if [ $HOST = x16 ]; then OTHERS="$O/seeds-w0.1/ttq_seeds.json $O/seeds-avg/ttq_seeds.json"
    else OTHERS=$O/seeds-w0.1/ttq_seeds.json; fi
    $P scripts/ttq_rebase_compute.py --steps-json $O/seeds-avg-h32-reset-lr6e-4/ttq_seeds.json \
        --method "d-local-avg|reset_momentum" --own $OWN --ref $REF --speedup $S --raw-links $LINKS \
        --others $OTHERS --rebased-others $O/seeds-diloco-bf16-h100/rebased.json \
        --out $O/seeds-avg-h32-reset-lr6e-4/rebased.json
  done
done
