#!/usr/bin/env python3
"""Quick self-test of the harness (~30 s): builds tiny random models and checks that

  - make_tiny.py is deterministic (same seed => identical safetensors) and writes the §2.4 names;
  - the f32 cast gives float32 logits;
  - greedy decoding with mlx-lm's KV cache (Gemma: RotatingKVCache, prompt longer than the window)
    agrees with the argmax of full-sequence forward passes;
  - ref_logits.py --out writes [T, vocab] little-endian f32 equal to an in-process forward pass.

    .venv/bin/python tools/ref/selftest.py
"""

import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

HERE = Path(__file__).resolve().parent
PY = sys.executable


def sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def make(out: Path, *args: str) -> None:
    subprocess.run([PY, str(HERE / "make_tiny.py"), "--out", str(out), "--force", *args], check=True,
                   capture_output=True)


def main() -> None:
    ok = 0
    with tempfile.TemporaryDirectory(prefix="mference-ref-selftest-") as t:
        tmp = Path(t)
        cases = [
            ("gemma4", ["--family", "gemma4", "--seed", "11", "--layer-types", "SSSF"], 262144),
            ("gemma4-2full-top4", ["--family", "gemma4", "--seed", "12", "--layer-types", "SFSF",
                                   "--top-k", "4", "--sliding-window", "32"], 262144),
            ("qwen36", ["--family", "qwen36", "--seed", "13"], 248320),
        ]
        rng = np.random.default_rng(0)
        for name, args, vocab in cases:
            a, b = tmp / f"{name}-a", tmp / f"{name}-b"
            make(a, *args)
            make(b, *args)
            assert sha(a / "model.safetensors") == sha(b / "model.safetensors"), f"{name}: not deterministic"
            model, _ = C.load_model_f32(a)
            ids = [int(x) for x in rng.integers(3, vocab, size=80)]
            if name.startswith("gemma4"):
                ids[0] = 2
            gen = C.greedy(model, ids, 8)
            full = C.forward_logits(model, ids + gen[:-1], start=len(ids) - 1)
            am = [int(x) for x in mx.argmax(full, axis=-1).tolist()]
            assert am == gen, f"{name}: cached greedy {gen} != full-forward argmax {am}"
            assert len(set(gen)) > 1, f"{name}: degenerate greedy output {gen}"
            tf = tmp / f"{name}.tokens.json"
            tf.write_text(json.dumps(ids))
            out = tmp / f"{name}.bin"
            subprocess.run([PY, str(HERE / "ref_logits.py"), "--model", str(a), "--tokens-file", str(tf),
                            "--out", str(out)], check=True, capture_output=True)
            side = json.loads(out.with_suffix(".json").read_text())
            got = np.fromfile(out, dtype="<f4").reshape(side["T"], side["vocab"])
            ref = C.np_f32(C.forward_logits(model, ids))
            assert side["T"] == len(ids) and side["vocab"] == vocab, side
            assert np.array_equal(got, ref), f"{name}: ref_logits.py output differs from forward pass"
            C.log(f"{name}: ok (greedy {gen})")
            ok += 1
    print(f"{ok} passed, 0 failed")


if __name__ == "__main__":
    main()
