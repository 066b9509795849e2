#!/usr/bin/env bash
# The README's test command: create the pinned mlx-lm reference venv if missing, then run every test.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
bash tools/ref/setup-venv.sh >/dev/null
# The venv's NVRTC (no GPU needed) on the loader path: the CUDA kernels are compiled for Hopper by
# the kernel compile test instead of being skipped.
nvrtc="$(echo "$repo"/.venv/lib/python3.11/site-packages/nvidia/cu13/lib)"
if [ -d "$nvrtc" ]; then export LD_LIBRARY_PATH="$nvrtc${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"; fi
cargo test --release --workspace "$@"
