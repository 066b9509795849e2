#!/usr/bin/env python3
"""Checks synth.py's tensor plan against a real MLX checkpoint's safetensors headers: for the
checkpoint's own config.json the plan must list exactly the same tensor names, dtypes and shapes.

    python3 tools/synth/check_plan.py assets/models/gemma4-tiny assets/models/qwen3_6-tiny
"""
import json
import struct
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import synth  # noqa: E402


def headers(d: Path) -> dict:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        with open(f, "rb") as fh:
            n = struct.unpack("<Q", fh.read(8))[0]
            h = json.loads(fh.read(n))
        h.pop("__metadata__", None)
        out.update({k: (v["dtype"], list(v["shape"])) for k, v in h.items()})
    return out


def main() -> int:
    bad = 0
    for d in map(Path, sys.argv[1:]):
        cfg = json.loads((d / "config.json").read_text())
        plan = {n: (dt, shape) for n, dt, shape, _, _ in synth.mlx_tensors(synth.plan_of(cfg), cfg)}
        real = headers(d)
        missing, extra = sorted(set(real) - set(plan)), sorted(set(plan) - set(real))
        diff = sorted(n for n in set(plan) & set(real) if plan[n] != real[n])
        for what, names in (("missing", missing), ("unexpected", extra)):
            for n in names:
                print(f"{d}: {what} {n}")
        for n in diff:
            print(f"{d}: {n}: plan {plan[n]} != checkpoint {real[n]}")
        bad += len(missing) + len(extra) + len(diff)
        print(f"{d}: {len(real)} tensors, {len(missing) + len(extra) + len(diff)} differences")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
