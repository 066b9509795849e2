#!/usr/bin/env bash
# Builds llama.cpp (CPU only, -march=native) from the llama-cpp-python 0.3.36 PyPI source package,
# whose vendored llama.cpp knows gemma4 and qwen35moe, with our routing patch applied (inert unless
# its variables are set). Output: work/llama/build/bin/{llama-bench,llama-simple,llama-completion}.
# Needs tools/bench/setup.sh first (cmake, ninja from PyPI).
#
#   tools/bench/build_llama.sh            # idempotent: skips the download / build if already there
#
# On CPUs with AMX (Intel Xeon from Sapphire Rapids on), the -march=native build's AMX path for
# repacked Q4_0 (ggml_backend_amx_mul_mat) dies with SIGSEGV at its first ldtilecfg in this tree
# (seen on a 2-core Xeon VM, 2026-12-05), so llama.cpp's default cannot run there; its default with
# AVX-512 repacking and AMX off is the peer we measure:
#   LLAMA_BUILD_DIR=work/llama/build-noamx LLAMA_CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON \
#     -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=ON \
#     -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF \
#     -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" tools/bench/build_llama.sh
set -euo pipefail
REPO="$(cd "$(dirname "$0")/../.." && pwd)"
VENV="$REPO/.venv-bench"
W="${LLAMA_DIR:-$REPO/work/llama}"  # LLAMA_DIR: build elsewhere (a shared copy)
VER=0.3.36
SRC="$W/llama_cpp_python-$VER/vendor/llama.cpp"
mkdir -p "$W"
export PATH="$VENV/bin:$PATH"
if [ ! -d "$SRC" ]; then
  # The sdist only (no wheel, no dependencies): its metadata step needs just scikit-build-core.
  pip download --no-deps --no-binary llama-cpp-python "llama-cpp-python==$VER" -d "$W"
  tar -xzf "$W/llama_cpp_python-$VER.tar.gz" -C "$W"
fi
# The routing patch (llama-routing-trace.patch): inert unless MFERENCE_ROUTING_TRACE (replay recorded
# expert ids, as `mference bench --routing-trace` does) or MFERENCE_ROUTING_LOG is set.
if ! grep -q MFERENCE_ROUTING_TRACE "$SRC/src/llama-graph.cpp"; then
  patch -d "$SRC" -p1 <"$REPO/tools/bench/llama-routing-trace.patch"
fi
B="${LLAMA_BUILD_DIR:-$W/build}"  # LLAMA_BUILD_DIR: a second build; LLAMA_CMAKE_ARGS: extra flags
cmake -S "$SRC" -B "$B" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF \
  -DBUILD_SHARED_LIBS=OFF ${LLAMA_CMAKE_ARGS:-} >"$B.cmake.log"
cmake --build "$B" -j "${JOBS:-2}" --target llama-bench llama-simple llama-completion
ls -la "$B/bin"
