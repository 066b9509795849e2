#!/usr/bin/env bash
# The README's first command: build mference, install the bundled trained tiny Gemma 4 through the
# real installer (first run only), and generate English text from a prompt.
#
#   tools/demo.sh ["your prompt"]   # extra flags (after the prompt, or alone) go to `mference run`
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
src="assets/models/gemma4-tiny"
out="work/gemma4-tiny.gturbo"
default_prompt="It is a truth universally acknowledged, that"
case "${1:-}" in
    -h | --help)
        echo "usage: tools/demo.sh [\"your prompt\"] [mference run flags, e.g. --temperature 0]"
        echo "Builds mference, installs the bundled tiny Gemma 4 (first run) and writes 64 tokens"
        echo "after the prompt (default: \"$default_prompt\"). \`mference run --help\` lists the flags."
        exit 0
        ;;
    -*) prompt="$default_prompt" ;; # flags only: the default prompt, every argument to `run`
    *)
        prompt="${1:-$default_prompt}"
        shift || true
        ;;
esac

# The bundled checkpoint must be byte-for-byte the one its README describes.
while read -r file sum; do
    got="$(sha256sum "$src/$file" | cut -d' ' -f1)"
    if [ "$got" != "$sum" ]; then
        echo "demo: $src/$file has sha256 $got, its README says $sum: the bundled model is damaged" >&2
        exit 1
    fi
done < <(grep -E '^\| `[^`]+` \| [0-9,]+ \| `[0-9a-f]{64}` \|' "$src/README.md" | sed -E 's/^\| `([^`]+)` \| [0-9,]+ \| `([0-9a-f]{64})` \|.*/\1 \2/')

cargo build --release --quiet -p mference-cli
bin="${CARGO_TARGET_DIR:-target}/release/mference"
if [ -d "$out" ] && ! "$bin" verify "$out" >/dev/null 2>&1; then
    # A damaged or unfinished demo install (a killed first run, an edited file): make it again.
    echo "demo: $out does not verify; reinstalling it" >&2
    "$bin" discard "$out" >/dev/null 2>&1 || true
    "$bin" install "$src" --output "$out" --overwrite
elif [ ! -d "$out" ]; then
    mkdir -p work
    "$bin" discard "$out" >/dev/null 2>&1 || true
    "$bin" install "$src" --output "$out"
fi
# 64 new tokens unless the caller chose another --max-new.
case " $* " in *" --max-new"*) ;; *) set -- --max-new 64 "$@" ;; esac
"$bin" run --model "$out" --prompt "$prompt" "$@"
