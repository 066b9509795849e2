#!/bin/bash
# Router lookahead A/B (docs/BENCHMARKS.md "Router lookahead"): `bench --router-lookahead 0` vs `2`,
# alternating order, ROUNDS rounds, each (model, slots) pair of runs under `flock $LOCK`.
#   tools/bench/router_lookahead.sh full  MODEL.gturbo OUT   # full-size synthetic Gemma 26B: trace
#                                                            # routing, 22 and 64 slots, prompts 64,512, gen 32
#   tools/bench/router_lookahead.sh tiny  MODEL.gturbo OUT   # a trained tiny model: its own routing,
#                                                            # 8 slots, prompt 64, gen 256, forced ids
# Env: MFERENCE (default target/release/mference), ROUNDS (3), LOCK (/work/bench.lock).
set -euo pipefail
mode=$1 model=$2 out=$3
B=${MFERENCE:-target/release/mference}
ROUNDS=${ROUNDS:-3}
LOCK=${LOCK:-/work/bench.lock}
TRACE=${TRACE:-assets/traces/gemma4-26b-a4b-routing.npy}
mkdir -p "$out"
common=(--model "$model" --direct-io --threads 2)
if [ "$mode" = full ]; then
  # 22 slots: --host-expert-cache of 22 x stride x 30 layers (Gemma 26B: stride 3,358,720 B).
  settings=("22:--host-expert-cache 2216755200" "64:--slots 64")
  extra=(--prompts 64,512 --gen 32 --routing-trace "$TRACE")
else
  settings=("8:--slots 8")
  extra=(--prompts 64 --gen 256 --decode forced)
fi
for r in $(seq 1 "$ROUNDS"); do
  i=0
  for s in "${settings[@]}"; do
    slots=${s%%:*}; flags=${s#*:}
    if [ $(( (r + i) % 2 )) = 1 ]; then order="0 2"; else order="2 0"; fi
    i=$((i + 1))
    for la in $order; do
      echo "$(date -u +%H:%M:%S) round $r slots $slots lookahead $la ($(cut -d' ' -f1-3 /proc/loadavg))"
      # shellcheck disable=SC2086
      flock "$LOCK" "$B" bench "${common[@]}" $flags "${extra[@]}" --router-lookahead "$la" \
        --json "$out/$slots-$la-$r.json" > "$out/$slots-$la-$r.txt" 2>&1
    done
  done
done
