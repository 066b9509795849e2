#!/usr/bin/env bash
# The full Gemma 4 26B-A4B side by side, as recorded in docs/BENCHMARKS.md. Needs ~30 GB free under
# work/ at peak (source 14.2 GB, deleted after install; install 14.3 GB; GGUF 14.2 GB) and root for
# the capped mode's cgroup. FAMILY=qwen36-35b does the same for Qwen 3.6 35B-A3B (~40 GB at peak).
set -euo pipefail
REPO="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$REPO"
M="${FAMILY:-gemma4-26b}"
W="$REPO/work"
PY="$REPO/.venv-bench/bin/python"
tools/bench/setup.sh
tools/bench/build_llama.sh
cargo build --release -p mference-cli
mkdir -p "$W"
[ -d "$W/$M.gturbo" ] || {
  "$PY" tools/synth/synth.py mlx --model "$M" --out "$W/$M-synth"
  target/release/mference install "$W/$M-synth" --output "$W/$M.gturbo"
  rm -rf "$W/$M-synth"
}
[ -f "$W/$M.gguf" ] || "$PY" tools/synth/synth.py gguf --model "$M" --out "$W/$M.gguf"
"$PY" tools/bench/compare.py --ours "$W/$M.gturbo" --gguf "$W/$M.gguf" --threads 2 \
  --prompts 64,512 --gen 32 --repeats 3 --modes warm --out "$W/cmp-$M-warm.json"
"$PY" tools/bench/compare.py --ours "$W/$M.gturbo" --gguf "$W/$M.gguf" --threads 2 \
  --prompts 64,512 --gen 16 --repeats 1 --modes capped --cap-gib 8 --out "$W/cmp-$M-capped.json"
# Peak RSS at 4K context, 16 slots (one 4000-token prompt, --max-context 4096).
target/release/mference bench --model "$W/$M.gturbo" --prompts 4000 --gen 32 --max-context 4096 \
  --slots 16 --threads 2 --decode forced --json "$W/bench-$M-4k.json"
