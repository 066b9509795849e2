#!/usr/bin/env python3
"""Reference logits / greedy continuation from mlx-lm (float32 compute).

    .venv/bin/python tools/ref/ref_logits.py --model DIR --tokens-file F.json --out OUT.bin
    .venv/bin/python tools/ref/ref_logits.py --model DIR --tokens-file F.json --greedy 64 --greedy-out G.json

--out writes the logits of EVERY position of one full-prompt forward pass (no KV cache) as raw
little-endian float32, row-major [T, vocab]; row t is the distribution of token t+1 given tokens
0..t. A sidecar OUT.json (OUT with its suffix replaced by .json) holds {"T", "vocab", "dtype",
"layout", "tokens", ...}.

--greedy N decodes N tokens greedily (argmax; first max on ties) with mlx-lm's KV cache
(make_prompt_cache: the whole prompt in one pass, then one token per step) and writes
{"prompt": [...], "generated": [...]} as JSON to --greedy-out (default: stdout).

The model is loaded with mlx_lm.utils.load_model and every bf16 parameter (norms, scalars,
quantization scales and biases) is cast to float32, so the stored 4-bit weights are used exactly
and all activations are float32 (checked).
"""

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

import mlx.core as mx  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="MLX model folder (config.json + model*.safetensors)")
    ap.add_argument("--tokens-file", required=True, help="JSON list of token ids (or {\"tokens\": [...]})")
    ap.add_argument("--out", help="raw f32 logits [T, vocab] output file")
    ap.add_argument("--greedy", type=int, default=0, metavar="N", help="greedy-decode N new tokens")
    ap.add_argument("--greedy-out", help="JSON output for --greedy (default stdout)")
    args = ap.parse_args()
    if not args.out and not args.greedy:
        ap.error("nothing to do: give --out and/or --greedy N")

    ids = C.read_token_file(args.tokens_file)
    model, config = C.load_model_f32(args.model)
    vocab_cfg = C.text_config(config).get("vocab_size")

    if args.out:
        t0 = time.time()
        logits = C.forward_logits(model, ids)
        mx.eval(logits)
        T, V = logits.shape
        assert T == len(ids), (T, len(ids))
        arr = C.np_f32(logits)
        assert arr.dtype.str == "<f4", arr.dtype
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        arr.tofile(out)
        side = {
            "T": T,
            "vocab": V,
            "config_vocab_size": vocab_cfg,
            "dtype": "f32",
            "endianness": "little",
            "layout": "row-major [T, vocab]; row t = logits after reading tokens[0..=t]",
            "tokens": ids,
            "model": str(args.model),
            "compute": "float32 (bf16 params cast to f32 after load; 4-bit weights exact)",
            "forward": "one full-sequence pass, no KV cache",
            "versions": C.versions(),
            "seconds": round(time.time() - t0, 3),
        }
        with open(out.with_suffix(".json"), "w") as f:
            json.dump(side, f, indent=1)
            f.write("\n")
        C.log(f"wrote {out} [{T}, {V}] f32 and {out.with_suffix('.json')} in {side['seconds']} s")

    if args.greedy:
        t0 = time.time()
        gen = C.greedy(model, ids, args.greedy)
        res = {"prompt": ids, "generated": gen, "compute": "float32, mlx-lm KV cache",
               "seconds": round(time.time() - t0, 3)}
        text = json.dumps(res) + "\n"
        if args.greedy_out:
            Path(args.greedy_out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.greedy_out).write_text(text)
            C.log(f"wrote {args.greedy_out} ({len(gen)} ids) in {res['seconds']} s")
        else:
            sys.stdout.write(text)


if __name__ == "__main__":
    main()
