#!/usr/bin/env bash
# Bit-identity A/B of two builds: `mference logits` byte for byte, for every golden fixture case
# (assets/fixtures/{deepseek_v4,inkling,maple}/{A,B}) and the two bundled tiny models, in three
# modes (prefill, decode, chunk:7) and two kernel tables (auto, scalar). Each build installs the
# checkpoints itself, and the installs' manifests are compared too. A refactor that claims no
# behaviour change must print "identical" for every line.
#
#   tools/ab_logits.sh OLD_BIN NEW_BIN [WORK_DIR]     # exit 1 on any difference
#
# Env: AB_CASES (an extended regex: only the case names it matches, e.g. 'tiny'), AB_FLAGS (more
# `logits` flags for both builds, e.g. '--device cuda --gpu-expert-budget resident'), AB_KERNELS
# (default 'auto scalar').
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
old="$(realpath "$1")"
new="$(realpath "$2")"
work="${3:-$repo/work/ab_logits}"
rm -rf "$work"
mkdir -p "$work"

# name -> checkpoint dir; prompt ids: the fixture's own, or 48 fixed ids for the tiny models.
cases=()
for fam in deepseek_v4 inkling maple; do
    for c in A B; do cases+=("$fam-$c:assets/fixtures/$fam/$c/checkpoint:assets/fixtures/$fam/$c/prompt_ids.json"); done
done
python3 -c 'import json; print(json.dumps([2] + [(i * 7919 + 13) % 4000 + 10 for i in range(47)]))' >"$work/tiny_ids.json"
cases+=("gemma4-tiny:assets/models/gemma4-tiny:$work/tiny_ids.json")
cases+=("qwen3_6-tiny:assets/models/qwen3_6-tiny:$work/tiny_ids.json")

fail=0
for entry in "${cases[@]}"; do
    IFS=: read -r name ckpt ids <<<"$entry"
    [[ "$name" =~ ${AB_CASES:-.} ]] || continue
    for side in old new; do
        bin="${!side}"
        "$bin" install "$repo/$ckpt" --output "$work/$side-$name.gturbo" >"$work/$side-$name.install.log" 2>&1
    done
    if ! cmp -s "$work/old-$name.gturbo/manifest.json" "$work/new-$name.gturbo/manifest.json"; then
        echo "DIFFERENT manifest.json $name"
        fail=1
    fi
    for kernels in ${AB_KERNELS:-auto scalar}; do
        for mode in prefill decode chunk:7; do
            for side in old new; do
                bin="${!side}"
                "$bin" logits --model "$work/$side-$name.gturbo" --ids "$ids" --mode "$mode" \
                    --kernels "$kernels" ${AB_FLAGS:-} --out "$work/$side-$name-$kernels-${mode/:/}.npy" \
                    >"$work/$side-$name-$kernels-${mode/:/}.log" 2>&1
            done
            if cmp -s "$work/old-$name-$kernels-${mode/:/}.npy" "$work/new-$name-$kernels-${mode/:/}.npy"; then
                echo "identical  $name $kernels $mode"
            elif [ ! -s "$work/old-$name-$kernels-${mode/:/}.npy" ]; then
                echo "FAILED     $name $kernels $mode (see $work/old-$name-$kernels-${mode/:/}.log)"
                fail=1
            else
                echo "DIFFERENT  $name $kernels $mode"
                fail=1
            fi
        done
    done
done
exit "$fail"
