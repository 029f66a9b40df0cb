#!/usr/bin/env bash
set -e
# The held-out rule's part 17, stage 2 (docs/results/ttq-heldout/rule_part17.txt): DiLoCo with AdamW and the 4-bit all-reduce
# at each setting stage 2 names on the emulated 16x and 4x hosts, its evaluation seeds composed with that setting's own e2e run
# and moved onto the others' compute-only step beside every row, targets 2.1 and 2.2, into seeds-NAME/rebased.json; then the
# 3-fragment vote (lr 4e-4, the tables' row) beside all of them, into that row's rebased-vs-diloco-fp4.json and
# rebased-vs-peers-fp4.json, and the defaults' and H = 16's rows beside every DiLoCo row, into their rebased-vs-diloco-fp4.json.
# The settings (NAME: H, streamed with tau, at which rate; SETTINGS="NAME ..." for some, HOSTS="x16"):
#   16x: diloco-fp4-st-h100       H = 100, tau = 75, 50 Mbit/s    diloco-fp4-st-h100-d35  H = 100, tau = 35, 100 Mbit/s
#        diloco-fp4-h100          H = 100, not streamed, 1 Gbit/s diloco-fp4-st-h50-d5    H = 50, tau = 5, 1 Gbit/s
#        diloco-fp4-st-h50-d36    H = 50, tau = 36, 100 Mbit/s
#   4x:  diloco-fp4-h100          H = 100, not streamed, 1 Gbit/s (the 16x host's seeds)
#        diloco-fp4-st-h100-d9    H = 100, tau = 9, 100 Mbit/s    diloco-fp4-st-h50-d11   H = 50, tau = 11, 100 Mbit/s
#        diloco-fp4-h50           H = 50, not streamed, 1 Gbit/s
#        diloco-fp4-st-h100-d18   H = 100, tau = 18, 50 Mbit/s    diloco-fp4-st-h50-d20   H = 50, tau = 20, 50 Mbit/s
# Run from anywhere, after the other compose_*.sh scripts (whose outputs this one reads), the e2e runs
#   dlion bench e2e --link 3125kbit --queue 800ms --ties random --methods compute,diloco-adamw-fp4-st-h100 --stream-delay 75 \
#       --fragment-alpha 0.5 --outer-lr 1.0 --steps 200 --warmup 3 --fused --no-progress --out docs/results/e2e-local-x16-fp4-st
#   (tau = 35: --link 6250kbit --stream-delay 35 ... --out docs/results/e2e-local-x16-fp4-st-100mbit;
#    H = 50: --methods compute,diloco-adamw-fp4-st-h50 --outer-lr 0.7 and --link 62500kbit --stream-delay 5
#    --out docs/results/e2e-local-x16-fp4-st-h50-1gbit, or --link 6250kbit --stream-delay 36 --out ...-h50-100mbit;
#    the 4x host: --link 25mbit --queue 200ms --bucket-mb 6, --stream-delay 9 (H = 100) or 11 (H = 50),
#    --out docs/results/e2e-local-x4-fp4-st-h100-100mbit or ...-x4-fp4-st-h50-100mbit; at 50 Mbit/s --link 12500kbit,
#    --stream-delay 18 (H = 100) or 20 (H = 50), --out docs/results/e2e-local-x4-fp4-st-h100-50mbit or ...-st-h50-50mbit;
#    not streamed: stage 1's e2e-local-x16-fp4 and e2e-local-x4-fp4)
# and the seeds K = 0-4 of each setting:
#   dlion bench ttq $R --methods diloco-adamw-fp4-st --sync-every 100 --stream-delay TAU --fragment-alpha 0.5 --outer-lr 1.0 \
#       --lr 1e-4 --seed K --out docs/results/ttq-heldout/diloco-fp4-st-h100-dTAU-a0.5-olr1.0-lr1e-4-seedK
#   dlion bench ttq $R --methods diloco-adamw-fp4 --sync-every 100 --outer-lr 1.0 --lr 1e-4 --seed K \
#       --out docs/results/ttq-heldout/diloco-fp4-h100-olr1.0-lr1e-4-seedK
#   dlion bench ttq $R --methods diloco-adamw-fp4 --sync-every 50 --outer-lr 0.7 --lr 2e-4 --seed K \
#       --out docs/results/ttq-heldout/diloco-fp4-h50-olr0.7-lr2e-4-seedK
#   dlion bench ttq $R --methods diloco-adamw-fp4-st --sync-every 50 --stream-delay TAU --fragment-alpha 0.5 --outer-lr 0.7 \
#       --lr 2e-4 --seed K --out docs/results/ttq-heldout/diloco-fp4-st-h50-dTAU-a0.5-olr0.7-lr2e-4-seedK
cd "$(dirname "$0")/../../.."
P=${PYTHON:-python}
. docs/results/ttq-heldout-x16/compose_common.sh
setting() {  # HOST NAME -> RUNS (seed prefix), METHOD (its key in the curves), E2E (its e2e method), OWN (that run), LINK
  local E=docs/results/e2e-local-$1-fp4 ST="stream_delay=TAU|fragment_alpha=0.5"
  case $1:$2 in
    x16:diloco-fp4-st-h100) RUNS=diloco-fp4-st-h100-d75-a0.5-olr1.0-lr1e-4-seed; METHOD=${ST/TAU/75}; OWN=$E-st; LINK=50mbit ;;
    x16:diloco-fp4-st-h100-d35) RUNS=diloco-fp4-st-h100-d35-a0.5-olr1.0-lr1e-4-seed; METHOD=${ST/TAU/35}; OWN=$E-st-100mbit; LINK=100mbit ;;
    x4:diloco-fp4-st-h100-d9) RUNS=diloco-fp4-st-h100-d9-a0.5-olr1.0-lr1e-4-seed; METHOD=${ST/TAU/9}; OWN=$E-st-h100-100mbit; LINK=100mbit ;;
    x16:diloco-fp4-st-h50-d5) RUNS=diloco-fp4-st-h50-d5-a0.5-olr0.7-lr2e-4-seed; METHOD=${ST/TAU/5}; OWN=$E-st-h50-1gbit; LINK=1gbit ;;
    x16:diloco-fp4-st-h50-d36) RUNS=diloco-fp4-st-h50-d36-a0.5-olr0.7-lr2e-4-seed; METHOD=${ST/TAU/36}; OWN=$E-st-h50-100mbit; LINK=100mbit ;;
    x4:diloco-fp4-st-h50-d11) RUNS=diloco-fp4-st-h50-d11-a0.5-olr0.7-lr2e-4-seed; METHOD=${ST/TAU/11}; OWN=$E-st-h50-100mbit; LINK=100mbit ;;
    x4:diloco-fp4-st-h100-d18) RUNS=diloco-fp4-st-h100-d18-a0.5-olr1.0-lr1e-4-seed; METHOD=${ST/TAU/18}; OWN=$E-st-h100-50mbit; LINK=50mbit ;;
    x4:diloco-fp4-st-h50-d20) RUNS=diloco-fp4-st-h50-d20-a0.5-olr0.7-lr2e-4-seed; METHOD=${ST/TAU/20}; OWN=$E-st-h50-50mbit; LINK=50mbit ;;
    *:diloco-fp4-h100) RUNS=diloco-fp4-h100-olr1.0-lr1e-4-seed; METHOD=""; OWN=$E; LINK=1gbit ;;
    x4:diloco-fp4-h50) RUNS=diloco-fp4-h50-olr0.7-lr2e-4-seed; METHOD=""; OWN=$E; LINK=1gbit ;;
    *) echo "unknown setting $2 on the $1 host" >&2; exit 2 ;;
  esac
  case $2 in *-st-h50*) E2E=diloco-adamw-fp4-st-h50 ;; *-st-h100*) E2E=diloco-adamw-fp4-st-h100 ;; *-h50) E2E=diloco-adamw-fp4-h50 ;; *) E2E=diloco-adamw-fp4-h100 ;; esac
  METHOD=diloco-adamw-fp4${METHOD:+-st|$METHOD}; RUNS=docs/results/ttq-heldout/$RUNS; OWN=$OWN/e2e_results.json
}
for HOST in ${HOSTS:-x16 x4}; do
host $HOST
if [ $HOST = x16 ]; then ALL="diloco-fp4-st-h100 diloco-fp4-st-h100-d35 diloco-fp4-h100 diloco-fp4-st-h50-d5 diloco-fp4-st-h50-d36"
else ALL="diloco-fp4-h100 diloco-fp4-st-h100-d9 diloco-fp4-st-h50-d11 diloco-fp4-h50 diloco-fp4-st-h100-d18 diloco-fp4-st-h50-d20"; fi
for T in 2.1 2.2; do
  target $HOST $T
  ROWS=""   # every row already moved onto the others' compute-only step, for this host and target
  for NAME in diloco-bf16-h100 diloco-bf16-h100-olr1.0 diloco-bf16-h50 diloco-bf16-st-h100 diloco-bf16-st-h50 avg-h32-reset \
              avg-h32-reset-lr6e-4 avg-h25-reset avg-h50-reset avg-st-h25-d11 avg-st-h25-d3 avg-st-h25-f3-rates-lr4e-4 avg-h16-reset \
              avg-h16-reset-slow; do
    [ -f $O/seeds-$NAME/rebased.json ] && ROWS="$ROWS $O/seeds-$NAME/rebased.json"
  done
  MINE=""
  for NAME in ${SETTINGS:-$ALL}; do
    setting $HOST $NAME
    [ -f ${RUNS}4/ttq_results.json ] || { echo "skipping $NAME: its seeds have not all run" >&2; continue; }
    compose_seeds $RUNS $OWN $T $NAME
    D=$O/seeds-$NAME/rebased.json
    $P scripts/ttq_rebase_compute.py --steps-json $O/seeds-$NAME/ttq_seeds.json --method "$METHOD" --e2e-method $E2E \
        --own $OWN --ref $REF --speedup $S --raw-links $LINKS --links $LINK --others $OTHERS --rebased-others $ROWS \
        --out $D > /dev/null
    MINE="$MINE $D"
  done
  F=$O/seeds-avg-st-h25-f3-rates-lr4e-4
  $P scripts/ttq_rebase_compute.py --inputs-from $F/rebased.json --rebased-others $MINE --out $F/rebased-vs-diloco-fp4.json > /dev/null
  $P scripts/ttq_rebase_compute.py --inputs-from $F/rebased-vs-peers.json --rebased-others $MINE \
      --out $F/rebased-vs-peers-fp4.json > /dev/null
  # the defaults and the vote every 16 steps: their rebased.json's rivals, every DiLoCo row not yet among them and the 4-bit ones
  for V in avg-h32-reset avg-h16-reset avg-h16-reset-slow; do
    R=$O/seeds-$V/rebased.json; [ -f $R ] || continue
    ADD=""
    for X in $ROWS $MINE; do case $X in *seeds-diloco-*) grep -q "\"$X\"" $R || ADD="$ADD $X" ;; esac; done
    $P scripts/ttq_rebase_compute.py --inputs-from $R --rebased-others $ADD --out $O/seeds-$V/rebased-vs-diloco-fp4.json > /dev/null
  done
done
done
