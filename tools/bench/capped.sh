#!/usr/bin/env bash
# Issue 15 item 4: mference (routing replayed from the trace, `--slots auto` under the cap) against
# llama.cpp (`--repack 0`, replaying the same trace) under 8 and 4 GiB memory cgroups, cold page cache, medians of 3, with the
# floor's terms: the disk's O_DIRECT bandwidth (disk_bw.py) and mference's warm decode time per
# token (resident, files in the page cache, same trace).
#
#   tools/bench/capped.sh INSTALL GGUF TRACE OUTDIR      # root (cgroup v1), fio installed
#
# Env: LLAMA_BENCH (default work/llama/build/bin/llama-bench), MFERENCE (target/release/mference),
# CAPS (8,4), PROMPTS (64,512), GEN (32), REPEATS (3), ENGINES (ours,llama-trace: llama.cpp replaying
# the same trace, needs the patched build of build_llama.sh; llama = its own routers; ours-router adds
# mference on its own random routers), LLAMA_NO_PP=1 (skip llama.cpp's
# prefill runs: decode only), LOCK (a file: every timed step runs under
# `flock $LOCK`; compare.py takes it per engine run, for machines shared with other benchmarks).
set -euo pipefail
REPO="$(cd "$(dirname "$0")/../.." && pwd)"
INSTALL=$1 GGUF=$2 TRACE=$3 OUT=$4
PY="$REPO/.venv-bench/bin/python"
LLAMA_BENCH="${LLAMA_BENCH:-$REPO/work/llama/build/bin/llama-bench}"
MFERENCE="${MFERENCE:-$REPO/target/release/mference}"
CAPS="${CAPS:-8,4}" PROMPTS="${PROMPTS:-64,512}" GEN="${GEN:-32}" REPEATS="${REPEATS:-3}"
timed() { if [ -n "${LOCK:-}" ]; then flock "$LOCK" "$@"; else "$@"; fi; }
mkdir -p "$OUT"
name=$(basename "$INSTALL" .gturbo)

# 1. The disk's O_DIRECT read bandwidth at the install's expert stride.
[ -f "$OUT/disk-$name.json" ] ||
  timed "$PY" "$REPO/tools/bench/disk_bw.py" --install "$INSTALL" --out "$OUT/disk-$name.json"
bw=$("$PY" -c "import json,sys; d=json.load(open(sys.argv[1])); print(max(d['fio_GBps_median'], d['fio_1job_GBps_median']))" "$OUT/disk-$name.json")

# 2. Warm decode time per token: every expert resident (layer files mapped, in the page cache).
[ -f "$OUT/warm-$name.json" ] ||
  timed "$PY" "$REPO/tools/bench/compare.py" --ours "$INSTALL" --gguf "$GGUF" --mference "$MFERENCE" \
    --llama-bench "$LLAMA_BENCH" --threads 2 --prompts "$PROMPTS" --gen "$GEN" --repeats "$REPEATS" \
    --slots resident --routing-trace "$TRACE" --modes warm --engines ours --out "$OUT/warm-$name.json"
warm=$("$PY" -c "
import json,sys
d=json.load(open(sys.argv[1]))
print(','.join(f\"{s['prompt_tokens']}:{1e3 / s['decode_tok_s']:.2f}\" for s in d['warm']['ours']['summary']))" "$OUT/warm-$name.json")
echo "floor terms: O_DIRECT $bw GB/s; warm ms/token $warm"

# 3. Both engines under each cap, cold, alternating repeat by repeat (the lock per engine run).
"$PY" "$REPO/tools/bench/compare.py" --ours "$INSTALL" --gguf "$GGUF" --mference "$MFERENCE" \
  --llama-bench "$LLAMA_BENCH" --threads 2 --prompts "$PROMPTS" --gen "$GEN" --repeats "$REPEATS" \
  --slots auto --routing-trace "$TRACE" --modes capped --cap-gib "$CAPS" --llama-args "--repack 0" \
  --engines "${ENGINES:-ours,llama-trace}" ${LLAMA_NO_PP:+--llama-no-pp} --odirect-GBps "$bw" --warm-ms "$warm" ${LOCK:+--lock "$LOCK"} \
  --out "$OUT/capped-$name.json"
