#!/usr/bin/env bash
# libFuzzer runs of every parser that reads untrusted bytes (crates/fuzzing, fuzz/).
#
#   tools/fuzz.sh build                 # cargo +nightly fuzz build (needs `cargo install cargo-fuzz`)
#   tools/fuzz.sh run SECONDS [JOBS]    # every target for SECONDS, JOBS at a time (default: cores)
#
# Corpora start from the seeds of crates/fuzzing's smoke test and grow in fuzz/corpus/<target>;
# a crash leaves its input in fuzz/artifacts/<target>/. The summary line per target gives its
# executions, coverage and peak RSS (libFuzzer's -rss_limit_mb=2048 and -timeout=10 turn a huge
# allocation or a hang into a failure).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
targets=(safetensors_header checkpoint config_json manifest layout receipt resident_index journal chat_request completion_request tool_calls)
bin="fuzz/target/x86_64-unknown-linux-gnu/release"
case "${1:-}" in
build)
    (cd fuzz && cargo +nightly fuzz build --release)
    MFERENCE_FUZZ_SEEDS="$repo/fuzz/corpus" cargo test --release -p mference-fuzzing --test smoke -q
    ;;
run)
    secs="${2:?seconds}"
    jobs="${3:-$(nproc)}"
    mkdir -p fuzz/logs
    printf '%s\n' "${targets[@]}" | xargs -P "$jobs" -I{} sh -c \
        "mkdir -p fuzz/corpus/{} fuzz/artifacts/{} && '$bin/{}' -max_total_time=$secs -rss_limit_mb=2048 -timeout=10 -print_final_stats=1 -artifact_prefix=fuzz/artifacts/{}/ fuzz/corpus/{} > fuzz/logs/{}.log 2>&1; echo \"{} exit \$?\" >> fuzz/logs/exit.txt"
    for t in "${targets[@]}"; do
        runs=$(grep -o 'stat::number_of_executed_units: [0-9]*' "fuzz/logs/$t.log" | grep -o '[0-9]*$' || echo "?")
        cov=$(grep -o 'cov: [0-9]*' "fuzz/logs/$t.log" | tail -1 | grep -o '[0-9]*$' || echo "?")
        rss=$(grep -o 'stat::peak_rss_mb: *[0-9]*' "fuzz/logs/$t.log" | grep -o '[0-9]*$' || echo "?")
        crashes=$(ls "fuzz/artifacts/$t" 2>/dev/null | wc -l)
        echo "$t: executions $runs, coverage $cov, peak RSS ${rss} MB, findings $crashes"
    done
    ;;
*)
    echo "usage: tools/fuzz.sh build | run SECONDS [JOBS]" >&2
    exit 2
    ;;
esac
