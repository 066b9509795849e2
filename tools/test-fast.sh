#!/usr/bin/env bash
# The fast tier of the edit-compile-test loop: every crate's unit tests, the op harness (every op
# of every CPU kernel table against the f64 reference) and the model parity tests (the five
# families against their references: the trained tiny Gemma 4 / Qwen 3.6 against mlx-lm, the
# golden fixtures of DeepSeek-V4 / Inkling / Maple against transformers' float32 logits). About
# 3 minutes on 2 cores once built: 4m10s were measured with the full-width Qwen 3.6 35B layer
# check included, the slowest single test (278 of the parity tests' 497 test-seconds in one
# nextest run on a loaded machine), which now runs in the full suite only. The full suite, which
# CI runs, stays `tools/test.sh`.
#
#   tools/test-fast.sh [extra cargo test args, e.g. -p mference-models]
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
bash tools/ref/setup-venv.sh >/dev/null
nvrtc="$repo/.venv/lib/python3.11/site-packages/nvidia/cu13/lib"
if [ -d "$nvrtc" ]; then export LD_LIBRARY_PATH="$nvrtc${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"; fi
# One cargo invocation over the whole workspace: its feature set is the full suite's, so nothing
# already built for tools/test.sh is built again.
cargo test --release --workspace --lib --test backend_ops \
    --test gemma4_parity --test gemma4_tiny --test qwen36_parity \
    --test deepseek_v4_parity --test inkling_parity --test maple_parity "$@" \
    -- --skip qwen36_35b_layer_dims
