#!/usr/bin/env bash
# Creates <repo>/.venv-bench (numpy, gguf, cmake, ninja from PyPI, pinned in requirements.txt) for
# tools/synth and tools/bench. The test suite does not need it.
set -euo pipefail
REPO="$(cd "$(dirname "$0")/../.." && pwd)"
PY="${PYTHON:-python3.11}"
if [ ! -x "$REPO/.venv-bench/bin/python" ]; then
  "$PY" -m venv "$REPO/.venv-bench"
fi
"$REPO/.venv-bench/bin/pip" install -q -r "$REPO/tools/bench/requirements.txt"
echo "ready: $REPO/.venv-bench"
