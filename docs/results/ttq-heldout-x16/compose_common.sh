# Sourced by the compose_*.sh scripts (from the repository root, with P the Python to run): the emulated
# hosts' figures, each target's folder and every-step peers, and one row's five seeds composed.
host() {  # HOST (x16 or x4) -> S (the compute speed-up), REF (the peers' e2e run), LINKS (its link names)
  if [ "$1" = x16 ]; then S=16; REF=docs/results/e2e-local-x16/e2e_results.json; LINKS=3125kbit,6250kbit,62500kbit
  else S=4; REF=docs/results/e2e-faster-host-x4/e2e_results.json; LINKS=12500kbit,25mbit,250mbit; fi
}
target() {  # HOST T -> O (the folder of that host and target), OTHERS (the peers' seeds composed with REF)
  O=docs/results/ttq-heldout-$1; [ "$2" = 2.2 ] && O=$O-target2.2
  if [ "$1" = x16 ]; then OTHERS="$O/seeds-w0.1/ttq_seeds.json $O/seeds-avg/ttq_seeds.json"; else OTHERS=$O/seeds-w0.1/ttq_seeds.json; fi
}
compose_seeds() {  # RUNS OWN T NAME [ACROSS]: seeds $SEEDS (default 0-4) of RUNS<K>/ttq_results.json composed with OWN
  local K ACROSS=""  # into $O/NAME-seedK, then across the seeds into $O/seeds-ACROSS (default NAME)
  for K in ${SEEDS:-0 1 2 3 4}; do
    $P -m dlion bench ttq --curves $1$K/ttq_results.json --step-times $2 --target $3 --compute-speedup $S \
        --out $O/$4-seed$K > /dev/null
    ACROSS="$ACROSS $O/$4-seed$K/ttq_results.json"
  done
  $P -m dlion bench ttq --across $ACROSS --out $O/seeds-${5:-$4} > /dev/null
}
