#!/usr/bin/env python3
"""A/B of two mference builds on one install: `mference bench` of each build, alternating run by
run (A, B, A, B, ...) so drift on a shared machine hits both alike; prints the median prefill and
decode tok/s of each and the ratio B/A per prompt, and writes every run's JSON.

    tools/bench/ab.py --a /work/baseline/mference --b target/release/mference \
        --model work/gemma4-26b.gturbo --slots resident --prompts short,medium --rounds 3 \
        --out work/ab-gemma-resident.json

Extra arguments after `--` go to both benches (e.g. `-- --gen 32 --threads 2`).
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def bench(binary, args, extra):
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "bench.json"
        cmd = [binary, "bench", "--model", args.model, "--slots", args.slots,
               "--prompts", args.prompts, "--repeats", "1", "--json", str(out)] + extra
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--a", required=True, help="baseline mference binary")
    p.add_argument("--b", required=True, help="candidate mference binary")
    p.add_argument("--model", required=True)
    p.add_argument("--slots", default="16")
    p.add_argument("--prompts", default="short,medium")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", help="write all runs here (JSON)")
    args, extra = p.parse_known_args()
    extra = [e for e in extra if e != "--"]

    runs = {"a": [], "b": []}
    for r in range(args.rounds):
        for side in ("a", "b"):
            doc = bench(getattr(args, side), args, extra)
            runs[side].extend(doc["runs"])
            print(f"round {r + 1}/{args.rounds} {side} done", file=sys.stderr)

    def med(side, prompt, key):
        vals = [x[key] for x in runs[side] if x["prompt"] == prompt]
        return statistics.median(vals), len(vals)

    prompts = sorted({x["prompt"] for x in runs["a"]}, key=lambda s: [x["prompt"] for x in runs["a"]].index(s))
    print(f"model {args.model}  slots {args.slots}  rounds {args.rounds}  extra {' '.join(extra)}")
    print(f"{'prompt':>8} {'metric':>14} {'A median':>10} {'B median':>10} {'B/A':>7}")
    summary = []
    for pr in prompts:
        for key in ("prefill_tok_s", "decode_tok_s"):
            (a, na), (b, nb) = med("a", pr, key), med("b", pr, key)
            ratio = b / a if a else float("nan")
            summary.append({"prompt": pr, "metric": key, "a": a, "b": b, "ratio": ratio, "runs": [na, nb]})
            print(f"{pr:>8} {key:>14} {a:10.2f} {b:10.2f} {ratio:7.3f}")
    finite = all(x.get("finite", False) for s in runs.values() for x in s)
    print(f"all runs finite: {finite}")
    # Greedy decode of the same prompt must give the same tokens on both builds.
    for pr in prompts:
        gen = {side: {tuple(x["generated"]) for x in runs[side] if x["prompt"] == pr} for side in runs}
        print(f"{pr}: greedy tokens identical across builds and runs: {gen['a'] == gen['b'] and len(gen['a']) == 1}")
    if args.out:
        Path(args.out).write_text(json.dumps({"settings": vars(args), "extra": extra,
                                              "summary": summary, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
