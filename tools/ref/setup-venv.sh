#!/usr/bin/env bash
# Create (or refresh) <repo>/.venv for the mlx-lm reference harness in tools/ref.
#
#   bash tools/ref/setup-venv.sh          # idempotent; ~0.1 s when already up to date
#   FORCE=1 bash tools/ref/setup-venv.sh  # rebuild the venv from scratch
#
# The venv is considered up to date when .venv/.mference-ref-stamp holds the sha256 of
# tools/ref/requirements.txt (plus the Python version). Prints the venv's python path last.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
venv="$repo/.venv"
req="$here/requirements.txt"
stamp="$venv/.mference-ref-stamp"

find_python() {
    for cand in "${PYTHON:-}" python3.11 /usr/bin/python3.11 /usr/local/bin/python3.11; do
        [ -n "$cand" ] || continue
        if command -v "$cand" >/dev/null 2>&1; then
            if "$cand" -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 11) else 1)' 2>/dev/null; then
                command -v "$cand"
                return 0
            fi
        fi
    done
    return 1
}

want="$( (sha256sum "$req" | cut -d' ' -f1; echo py3.11) | sha256sum | cut -d' ' -f1)"

if [ "${FORCE:-0}" != "1" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] \
   && [ -x "$venv/bin/python" ]; then
    echo "$venv/bin/python"
    exit 0
fi

if [ "${FORCE:-0}" = "1" ]; then
    rm -rf "$venv"
fi

if [ ! -x "$venv/bin/python" ]; then
    py="$(find_python)" || {
        echo "setup-venv.sh: Python 3.11 not found (set PYTHON=/path/to/python3.11)" >&2
        exit 1
    }
    echo "setup-venv.sh: creating $venv with $py" >&2
    "$py" -m venv "$venv"
fi

if ! "$venv/bin/python" -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 11) else 1)'; then
    echo "setup-venv.sh: $venv is not Python 3.11; rerun with FORCE=1" >&2
    exit 1
fi

echo "setup-venv.sh: installing pinned requirements" >&2
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check -r "$req" >&2
"$venv/bin/python" -c 'import mlx.core as mx, mlx_lm, numpy, tokenizers, openai; mx.array([1.0]).item()' >&2
echo "$want" > "$stamp"
echo "$venv/bin/python"
