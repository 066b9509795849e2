#!/usr/bin/env bash
# Full-size synthetic Gemma 4 26B-A4B (or, with FAMILY=qwen36-35b, Qwen 3.6 35B-A3B) on one NVIDIA GPU: mference (--device cuda) at GPU expert
# budgets of resident / 25% / 10% of the expert bytes, side by side with llama.cpp built with CUDA
# (fully offloaded, and with --n-cpu-moe at the GPU memory of those budgets), as recorded in
# docs/BENCHMARKS.md. Needs nvcc, cmake, ninja, python3 with numpy, ~30 GB (Gemma) / ~40 GB
# (Qwen) free under WORK.
#
#   tools/bench/cuda_side_by_side.sh prepare WORK LLAMA_SRC   # llama.cpp build, checkpoint, GGUF, install
#   tools/bench/cuda_side_by_side.sh run WORK                 # the measurements, JSON under WORK
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
cmd="$1"
W="$2"
mkdir -p "$W"
case "$cmd" in
prepare)
  SRC="$3"
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
  I="$W/$M.gturbo"
  # Expert bytes: stride x experts x layers with an expert file.
  read -r EXPERT_BYTES LAYERS < <(python3 -c "
import json,sys; m=json.load(open('$I/manifest.json'))
n=sum(1 for k in m['files'] if k.startswith('packed_experts/layer_'))
print(m['expertStride']*m['expertsPerLayer']*n, n)")
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
  python3 - "$W" <<'EOF'
import glob, json, os, sys
w = sys.argv[1]
for f in sorted(glob.glob(f"{w}/ours-*.json")):
    b = os.path.basename(f)[5:-5]
    d = json.load(open(f))
    for r in d["summary"]:
        print("ours", b, json.dumps({k: r[k] for k in ("prompt_tokens", "prefill_tok_s", "ttft_s",
              "decode_tok_s", "hit_rate", "bytes_per_token", "read_wait_per_token_s",
              "gpu_expert_cache")}))
for f in ("llama-pp.json", "llama-tg.json"):
    for r in json.load(open(f"{w}/{f}")):
        print("llama", f, "ncmoe", r.get("n_cpu_moe"), "pp", r["n_prompt"], "tg", r["n_gen"],
              "depth", r.get("n_depth"), "avg_ts %.2f" % r["avg_ts"], "stddev %.2f" % r["stddev_ts"])
EOF
  ;;
esac
