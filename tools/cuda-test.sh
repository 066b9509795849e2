#!/usr/bin/env bash
# The CUDA backend's tests on a GPU machine: the op harness and model-sized shapes on device 0,
# the kernel cache, the NVRTC compile, the bundled models end to end. Needs the NVIDIA driver and libnvrtc (CUDA 13); NVRTC is
# often outside the loader path, so the toolkit's usual folders are added when they exist.
# Without a GPU, tools/cuda_ptxas.py compiles the same kernels with NVRTC and ptxas from PyPI wheels
# and prints their registers and spills.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
for d in /usr/local/cuda/targets/x86_64-linux/lib /usr/local/cuda/lib64; do
  if [ -d "$d" ]; then export LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"; fi
done
cargo test --release -p mference-cuda "$@" -- --nocapture
# The bundled tiny models on CUDA: greedy ids and perplexity against mlx-lm, bit-identity across
# GPU expert budgets (crates/cli/tests/cuda.rs).
cargo test --release -p mference-cli --test cuda "$@" -- --nocapture --test-threads 1
# The fixture families on CUDA (issue 30): DeepSeek-V4's, Inkling's and Maple's golden fixtures
# with the model on the GPU, against their reference logits at every position and greedy ids, and
# bit-identical across GPU expert memory (crates/models/tests/{deepseek_v4,inkling,maple}_parity.rs).
MFERENCE_TEST_DEVICE=cuda cargo test --release -p mference-models --test deepseek_v4_parity \
  --test inkling_parity --test maple_parity "$@" -- --nocapture --test-threads 1
