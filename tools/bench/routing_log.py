#!/usr/bin/env python3
"""Summarizes a routing log of the patched llama.cpp (MFERENCE_ROUTING_LOG=FILE, see
llama-routing-trace.patch): per MoE layer, over the decode rows (graph runs of one row), the
distinct experts used, the mean overlap of consecutive tokens' expert sets, and the hit rate a
per-layer LFU cache (recency tie-break, as mference's) of --slots slots would see. Compare with
the same numbers of a recorded trace (--trace): a router whose choice barely changes from token to
token gives any cache, the page cache included, a near-perfect hit rate.

    .venv-bench/bin/python tools/bench/routing_log.py LOG [--trace assets/traces/X.npy] [--slots 64]
"""

import argparse
import collections
import struct
from pathlib import Path

import numpy as np


def read_log(path: Path, k: int) -> dict:
    """layer -> list of [rows, k] int32 arrays (k = the model's experts per token), one per graph
    run, in order."""
    b, o, runs = path.read_bytes(), 0, collections.defaultdict(list)
    while o < len(b):
        layer, n = struct.unpack_from("<ii", b, o)
        o += 8
        ids = np.frombuffer(b, dtype="<i4", count=n * k, offset=o).reshape(n, k)
        o += n * k * 4
        runs[layer].append(ids)
    return runs


def lfu_hit_rate(rows: list, slots: int) -> float:
    count, last, cache, hits, lookups = collections.Counter(), {}, set(), 0, 0
    for t, row in enumerate(rows):
        want = set(int(e) for e in row)
        for e in want:
            count[e] += 1
            last[e] = t
        for e in sorted(want):
            lookups += 1
            if e in cache:
                hits += 1
                continue
            if len(cache) >= slots:
                cache.remove(min((x for x in cache if x not in want), key=lambda x: (count[x], last[x])))
            cache.add(e)
    return hits / max(lookups, 1)


def summary(name: str, per_layer: dict, slots: int) -> None:
    distinct, overlap, hit = [], [], []
    for layer in sorted(per_layer):
        rows = per_layer[layer]
        distinct.append(len({int(e) for r in rows for e in r}))
        overlap.append(np.mean([len(set(a) & set(b)) / len(a) for a, b in zip(rows, rows[1:])]))
        hit.append(lfu_hit_rate(rows, slots))
    print(f"{name}: {len(per_layer)} layers x {len(rows)} decode rows: distinct experts per layer "
          f"median {int(np.median(distinct))} (min {min(distinct)}, max {max(distinct)}); consecutive "
          f"overlap {100 * np.mean(overlap):.1f}%; LFU hit rate at {slots} slots {100 * np.mean(hit):.1f}%")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("log", type=Path)
    ap.add_argument("--trace", type=Path, help="a recorded trace (.npy) to compare with")
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8, help="experts per token of the model")
    a = ap.parse_args()
    runs = read_log(a.log, a.top_k)
    decode = {l: [tuple(r[0]) for r in rs if r.shape[0] == 1] for l, rs in runs.items()}
    n = min(len(v) for v in decode.values())
    summary(f"llama.cpp's own routing ({a.log.name})", decode, a.slots)
    if a.trace:
        t = np.load(a.trace)
        # The same number of consecutive rows from the middle of the trace's first 512-row chunk.
        summary(f"trace {a.trace.name}", {l: [tuple(t[p, l]) for p in range(256, 256 + n)]
                                          for l in range(t.shape[1])}, a.slots)


if __name__ == "__main__":
    main()
