#!/usr/bin/env bash
# Full-size synthetic Gemma 4 26B-A4B (or, with FAMILY=qwen36-35b, Qwen 3.6 35B-A3B) on one NVIDIA GPU: mference (--device cuda) at GPU expert
# budgets of resident / 25% / 10% of the expert bytes, side by side with llama.cpp built with CUDA
# (fully offloaded, and with --n-cpu-moe at the GPU memory of those budgets), as recorded in
# docs/BENCHMARKS.md. Needs nvcc, cmake, ninja, python3 with numpy, ~30 GB (Gemma) / ~40 GB
# (Qwen) free under WORK.
#
#   tools/bench/cuda_side_by_side.sh prepare WORK LLAMA_SRC   # llama.cpp build, checkpoint, GGUF, install
#   tools/bench/cuda_side_by_side.sh run WORK                 # the measurements, JSON under WORK
#   LLAMA_SRC=... tools/bench/cuda_side_by_side.sh consumer WORK   # 16 / 24 GB cards (issue 29 item 5)
#
# consumer: for each card size in GPU_GB (default "16 24"; GiB, of which 0.5 GiB is left to the
# driver and the desktop), both engines at the most GPU memory that fits: ours with the expert
# budget that fits beside what a 1 GiB-budget run measured for everything else (weights, KV,
# staging, scratch), `--gpu-miss-split auto`; llama.cpp with the fewest `-ncmoe` layers whose
# expert bytes (from the GGUF) bring its fully offloaded peak under the card. Each at THREADS host
# threads (default "8 16"). Every run's peak GPU memory (nvidia-smi, every 0.2 s) is recorded
# beside its JSON, so the fit is measured, not assumed. LLAMA_SRC (the prepare's source) gives
# the GGUF reader.
#
# LLAMA_SRC: the vendored llama.cpp of the pinned llama-cpp-python 0.3.36 sdist
# (`pip download --no-deps --no-binary llama-cpp-python llama-cpp-python==0.3.36`).
# Routing on our side is replayed from assets/traces (the bench says so); llama.cpp's placement is
# static, so its routing does not change its speed.
set -euo pipefail
REPO="$(cd "$(dirname "$0")/../.." && pwd)"
MF="${MF:-$REPO/target/release/mference}"
M="${FAMILY:-gemma4-26b}"
# Runs per measurement, both engines (REPEATS=1 when the device time is short).
REPEATS="${REPEATS:-3}"
# --gpu-miss-split settings measured under the 25% and 10% budgets (e.g. SPLITS="off auto").
SPLITS="${SPLITS:-off}"
case "$M" in
  gemma4-26b) TRACE="$REPO/assets/traces/gemma4-26b-a4b-routing.npy" ;;
  qwen36-35b) TRACE="$REPO/assets/traces/qwen3_6-35b-a3b-routing.npy" ;;
  *) echo "FAMILY must be gemma4-26b or qwen36-35b" >&2; exit 2 ;;
esac
# Prints every JSON under WORK: ours per budget (with its peak GPU memory where measured),
# llama.cpp per -ncmoe and thread count.
report() {
  python3 - "$1" <<'EOF'
import glob, json, os, sys
w = sys.argv[1]
for f in sorted(glob.glob(f"{w}/ours-*.json")):
    b = os.path.basename(f)[5:-5]
    d = json.load(open(f))
    mem = f"{w}/ours-{b}.mem"
    peak = open(mem).read().strip() if os.path.exists(mem) else None
    for r in d["summary"]:
        print("ours", b, "peak_MiB", peak, json.dumps({k: r[k] for k in ("prompt_tokens",
              "prefill_tok_s", "ttft_s", "decode_tok_s", "hit_rate", "bytes_per_token",
              "read_wait_per_token_s", "gpu_expert_cache")}))
for f in sorted(glob.glob(f"{w}/llama-*.json")):
    t = os.path.basename(f)[:-5]
    mem = f"{w}/llama-{t.split('-', 2)[-1]}.mem" if t.count("-") >= 2 else None
    peak = open(mem).read().strip() if mem and os.path.exists(mem) else None
    for r in json.load(open(f)):
        print("llama", t, "peak_MiB", peak, "ncmoe", r.get("n_cpu_moe"), "t", r.get("n_threads"),
              "pp", r["n_prompt"], "tg", r["n_gen"], "depth", r.get("n_depth"),
              "avg_ts %.2f" % r["avg_ts"], "stddev %.2f" % r["stddev_ts"])
EOF
}
usage="usage: $0 prepare WORK LLAMA_SRC | run WORK | consumer WORK (with LLAMA_SRC set)"
cmd="${1:-}"
W="${2:-}"
case "$cmd" in
  prepare | run | consumer) [ -n "$W" ] || { echo "$usage" >&2; exit 2; } ;;
  *) echo "$usage" >&2; exit 2 ;;
esac
# run and consumer measure what prepare made; expert bytes: stride x experts x layers with an
# expert file.
I="$W/$M.gturbo"
if [ "$cmd" != prepare ]; then
  if ! [ -f "$I/manifest.json" ]; then
    echo "no $I: run '$0 prepare $W LLAMA_SRC' first" >&2
    exit 2
  fi
  read -r EXPERT_BYTES LAYERS < <(python3 -c "
import json,sys; m=json.load(open('$I/manifest.json'))
n=sum(1 for k in m['files'] if k.startswith('packed_experts/layer_'))
print(m['expertStride']*m['expertsPerLayer']*n, n)")
fi
mkdir -p "$W"
case "$cmd" in
prepare)
  SRC="${3:?$usage}"
  # The GGUF writer is llama.cpp's own gguf-py (a machine without network has no `pip install gguf`).
  export PYTHONPATH="$SRC/gguf-py${PYTHONPATH:+:$PYTHONPATH}"
  # llama.cpp is built once per machine (a later family reuses it).
  ([ -x "$W/llama-build/bin/llama-bench" ] && echo "llama build reused" >"$W/build.done" ||
   { cmake -S "$SRC" -B "$W/llama-build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON \
      -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
      -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
      -DBUILD_SHARED_LIBS=OFF >"$W/cmake.log" 2>&1 &&
    cmake --build "$W/llama-build" -j "$(nproc)" --target llama-bench >"$W/build.log" 2>&1;
    echo "llama build rc=$?" >"$W/build.done"; }) &
  # The checkpoint, its install (the source deleted after it), then the GGUF: one after the
  # other, so the disk holds at most two copies of the model.
  (python3 "$REPO/tools/synth/synth.py" mlx --model $M --out "$W/$M-src" >"$W/synth-mlx.log" 2>&1 &&
    "$MF" install "$W/$M-src" --output "$W/$M.gturbo" >"$W/install.log" 2>&1 &&
    rm -rf "$W/$M-src"; echo "install rc=$?" >"$W/install.done"
   python3 "$REPO/tools/synth/synth.py" gguf --model $M --out "$W/$M.gguf" >"$W/synth-gguf.log" 2>&1;
    echo "gguf rc=$?" >"$W/gguf.done") &
  wait
  cat "$W"/*.done
  ;;
run)
  echo "expert bytes: $EXPERT_BYTES over $LAYERS layers"
  for b in resident 25 10; do
    case $b in
      resident) budget=resident; splits=off ;;
      *) budget=$((EXPERT_BYTES * b / 100)); splits=$SPLITS ;;
    esac
    for split in $splits; do
      tag=$b; [ "$split" = off ] || tag=$b-split-$split
      "$MF" bench --device cuda --model "$I" --prompts 512 --gen 64 --repeats "$REPEATS" \
        --decode forced --routing-trace "$TRACE" --gpu-expert-budget "$budget" \
        --host-expert-cache "$EXPERT_BYTES" --gpu-miss-split "$split" --json "$W/ours-$tag.json" \
        2>&1 | tail -4
    done
  done
  LB="$W/llama-build/bin/llama-bench"
  # -ncmoe N keeps the experts of the first N layers in host memory: 0 = fully offloaded, 3/4 and
  # 9/10 of the layers = about the GPU memory of our 25% and 10% budgets (22 and 27 of Gemma's
  # 30), all of them = --cpu-moe.
  NC="0,$((LAYERS * 3 / 4)),$((LAYERS * 9 / 10)),$LAYERS"
  "$LB" -m "$W/$M.gguf" -ngl 99 -ncmoe "$NC" -p 512 -n 0 -r "$REPEATS" -t "$(nproc)" -o json \
    >"$W/llama-pp.json"
  "$LB" -m "$W/$M.gguf" -ngl 99 -ncmoe "$NC" -p 0 -n 64 -d 512 -r "$REPEATS" -t "$(nproc)" -o json \
    >"$W/llama-tg.json"
  report "$W"
  ;;
consumer)
  : "${LLAMA_SRC:?consumer reads the GGUF with the gguf-py of llama.cpp: set LLAMA_SRC to the source given to prepare}"
  LB="$W/llama-build/bin/llama-bench"
  # llama.cpp's routed-expert bytes per layer, from the GGUF's tensor table.
  LLAMA_LAYER=$(PYTHONPATH="$LLAMA_SRC/gguf-py" python3 -c "
from gguf import GGUFReader
r = GGUFReader('$W/$M.gguf')
print(sum(int(t.n_bytes) for t in r.tensors if '_exps' in t.name) // $LAYERS)")
  base=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | head -1)
  # peak TAG CMD...: runs CMD, writes the GPU memory it added at its peak (MiB) to WORK/TAG.mem.
  peak() {
    local tag=$1; shift
    (while :; do nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | head -1; sleep 0.2; done) >"$W/$tag.poll" &
    local poll=$!
    "$@"
    kill $poll; wait $poll 2>/dev/null || true
    echo $(( $(sort -n "$W/$tag.poll" | tail -1) - base )) >"$W/$tag.mem"
    echo "$tag: peak $(cat "$W/$tag.mem") MiB on the GPU" >&2
  }
  # Everything but the expert slots: a run at a 1 GiB budget, less that budget.
  peak ours-probe "$MF" bench --device cuda --model "$I" --prompts 512 --gen 4 --repeats 1 \
    --decode forced --routing-trace "$TRACE" --gpu-expert-budget 1G \
    --host-expert-cache "$EXPERT_BYTES" --json "$W/ours-probe.json" >/dev/null 2>&1
  fixed=$(( $(cat "$W/ours-probe.mem") * 1048576 - 1073741824 ))
  peak llama-full "$LB" -m "$W/$M.gguf" -ngl 99 -ncmoe 0 -p 512 -n 0 -r 1 -o json >/dev/null 2>&1
  llama_full=$(( $(cat "$W/llama-full.mem") * 1048576 ))
  echo "ours without slots: $fixed B; llama.cpp fully offloaded: $llama_full B; its experts: $LLAMA_LAYER B per layer"
  for gb in ${GPU_GB:-16 24}; do
    card=$(( gb * 1073741824 - 536870912 ))
    budget=$(( card - fixed ))
    [ $budget -ge "$EXPERT_BYTES" ] && budget=resident
    over=$(( llama_full - card ))
    n=0; [ $over -gt 0 ] && n=$(( (over + LLAMA_LAYER - 1) / LLAMA_LAYER ))
    # The split applies under a budget only.
    split=(--gpu-miss-split auto); [ $budget = resident ] && split=()
    echo "== ${gb} GB: ours --gpu-expert-budget $budget, llama.cpp -ncmoe $n"
    for t in ${THREADS:-8 16}; do
      peak "ours-${gb}g-t$t" "$MF" bench --device cuda --model "$I" --prompts 512 --gen 64 \
        --repeats "$REPEATS" --decode forced --routing-trace "$TRACE" --gpu-expert-budget "$budget" \
        --host-expert-cache "$EXPERT_BYTES" "${split[@]}" --threads "$t" \
        --json "$W/ours-${gb}g-t$t.json" 2>&1 | tail -3
      peak "llama-${gb}g-t$t" "$LB" -m "$W/$M.gguf" -ngl 99 -ncmoe "$n" -p 512 -n 0 -r "$REPEATS" \
        -t "$t" -o json >"$W/llama-pp-${gb}g-t$t.json"
      "$LB" -m "$W/$M.gguf" -ngl 99 -ncmoe "$n" -p 0 -n 64 -d 512 -r "$REPEATS" -t "$t" -o json \
        >"$W/llama-tg-${gb}g-t$t.json"
    done
  done
  report "$W"
  ;;
esac
