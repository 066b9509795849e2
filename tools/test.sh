#!/usr/bin/env bash
# The README's test command: create the pinned mlx-lm reference venv if missing, then run every test.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
bash tools/ref/setup-venv.sh >/dev/null
cargo test --release --workspace "$@"
