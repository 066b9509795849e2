#!/usr/bin/env python3
"""Perplexity of an MLX checkpoint with mlx-lm in float32, llama-perplexity protocol.

    .venv/bin/python tools/ref/perplexity.py --model DIR --file TEXT --ctx 512 --max-tokens 8192 [--json-out R.json]

Protocol "llama" (default) = llama.cpp tools/perplexity/perplexity.cpp `perplexity()` (ppl_stride 0):
  1. Tokenize the whole text with the model folder's tokenizer.json (HF `tokenizers`,
     add_special_tokens=False), put BOS in front when the vocabulary adds one (see below), keep the
     first --max-tokens tokens.
  2. n_chunk = len(tokens) // ctx consecutive, non-overlapping chunks tokens[i*ctx:(i+1)*ctx]
     (llama.cpp requires len(tokens) >= 2*ctx).
  3. If the vocabulary adds BOS (tokenizer_config.json add_bos_token, i.e. llama.cpp's
     llama_vocab_get_add_bos), the FIRST token of each chunk is REPLACED by BOS (not prepended).
  4. Each chunk is one forward pass from an empty cache. With first = ctx//2, the logits at positions
     j = first .. ctx-2 are scored against token j+1 of the chunk: ctx - first - 1 predictions per
     chunk (255 for ctx 512).
  5. PPL = exp(sum NLL / count), NLL = -log_softmax(logits)[target] in float32, summed in float64.
As llama.cpp (common_tokenize with add_special=true), for a BOS-adding vocab the stream starts with
BOS (before the --max-tokens cut), which shifts every later chunk boundary by one token; pass
--no-stream-bos for a stream without it. `mference perplexity` does the same (--no-stream-bos too).

Protocol "shared" = the protocol behind the perplexities in shared/models/*/README.md
(shared/corpora/README.md): Gemma: chunks of ctx-1 text tokens, each fed as [BOS] + chunk and every
text token scored; Qwen (no BOS): chunks of ctx tokens (the last may be short), positions 1.. scored.
"""

import argparse
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402


def tokenize(model_dir: str, text: str) -> list[int]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(C.tokenizer_json_path(model_dir)))
    return tok.encode(text, add_special_tokens=False).ids


def vocab_adds_bos(model_dir: str, config: dict) -> tuple[bool, int | None]:
    d = C.resolve_model_dir(model_dir)
    add_bos = False
    p = d / "tokenizer_config.json"
    if p.exists():
        with open(p) as f:
            add_bos = bool(json.load(f).get("add_bos_token", False))
    bos = config.get("bos_token_id", C.text_config(config).get("bos_token_id"))
    if add_bos and bos is None:
        raise SystemExit("tokenizer adds BOS but config.json has no bos_token_id")
    return add_bos, bos


def chunk_nll(model, ids: list[int], score_from: int) -> np.ndarray:
    """NLL of ids[j+1] given ids[..=j] for j = score_from .. len(ids)-2 (float64 array)."""
    logits = C.forward_logits(model, ids, start=score_from)[:-1]  # [n, V] f32
    targets = mx.array(ids[score_from + 1:], dtype=mx.int32)
    lse = mx.logsumexp(logits, axis=-1)
    tgt = mx.take_along_axis(logits, targets[:, None], axis=-1)[:, 0]
    nll = lse - tgt
    mx.eval(nll)
    assert nll.dtype == mx.float32, nll.dtype
    return np.asarray(nll).astype(np.float64)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--file", required=True, help="UTF-8 text file")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=8192, help="use the first N tokens of the stream (0 = all)")
    ap.add_argument("--protocol", choices=["llama", "shared"], default="llama")
    ap.add_argument("--bos", choices=["auto", "yes", "no"], default="auto",
                    help="set chunk-initial BOS: auto = iff tokenizer_config.json add_bos_token")
    ap.add_argument("--no-stream-bos", dest="stream_bos", action="store_false",
                    help="llama protocol: no BOS at the head of the stream (mference before this change); "
                         "by default the stream starts with BOS when the vocabulary adds one, like "
                         "llama.cpp's common_tokenize(add_special=true)")
    ap.add_argument("--json-out", help="write the result (and per-chunk NLL) as JSON here")
    args = ap.parse_args()

    t_start = time.time()
    model, config = C.load_model_f32(args.model)
    add_bos, bos = vocab_adds_bos(args.model, config)
    if args.bos != "auto":
        add_bos = args.bos == "yes"
    text = Path(args.file).read_text(encoding="utf-8")
    stream = tokenize(args.model, text)
    n_text_tokens = len(stream)
    if args.stream_bos and add_bos:
        stream = [bos] + stream
    if args.max_tokens:
        stream = stream[: args.max_tokens]
    ctx = args.ctx

    chunks = []  # (ids fed, score_from)
    if args.protocol == "llama":
        if len(stream) < 2 * ctx:
            raise SystemExit(f"need at least {2 * ctx} tokens, have {len(stream)}")
        first = ctx // 2
        for i in range(len(stream) // ctx):
            ids = list(stream[i * ctx:(i + 1) * ctx])
            if add_bos:
                ids[0] = bos
            chunks.append((ids, first))
    else:
        if add_bos:
            step = ctx - 1
            for i in range(0, len(stream), step):
                chunks.append(([bos] + stream[i:i + step], 0))
        else:
            for i in range(0, len(stream), ctx):
                part = stream[i:i + ctx]
                if len(part) >= 2:
                    chunks.append((part, 0))

    C.log(f"{n_text_tokens} text tokens, using {len(stream)}; protocol {args.protocol}, ctx {ctx}, "
          f"BOS {'id %d at chunk start' % bos if add_bos else 'none'}; {len(chunks)} chunks")
    d = C.check_split_head(model, chunks[0][0])
    C.log(f"split-head check vs model(): max |diff| {d:g}")
    total, count, per_chunk = 0.0, 0, []
    for i, (ids, score_from) in enumerate(chunks):
        t0 = time.time()
        nll = chunk_nll(model, ids, score_from)
        total += float(nll.sum())
        count += nll.size
        per_chunk.append({"n": int(nll.size), "nll_sum": float(nll.sum())})
        C.log(f"chunk {i + 1}/{len(chunks)}: {nll.size} scored, mean NLL {nll.mean():.6f}, "
              f"running ppl {math.exp(total / count):.4f} ({time.time() - t0:.1f} s)")

    mean = total / count
    ppl = math.exp(mean)
    print(f"perplexity: {ppl:.4f}")
    print(f"mean NLL: {mean:.6f} nat/token over {count} predictions in {len(chunks)} chunks")
    res = {
        "perplexity": ppl,
        "mean_nll": mean,
        "predictions": count,
        "chunks": len(chunks),
        "ctx": ctx,
        "protocol": args.protocol,
        "max_tokens": args.max_tokens,
        "stream_tokens_used": len(stream),
        "text_tokens": n_text_tokens,
        "chunk_bos": bos if add_bos else None,
        "stream_bos": bool(args.stream_bos and add_bos),
        "model": str(args.model),
        "file": str(args.file),
        "compute": "float32 (bf16 params cast to f32 after load; 4-bit weights exact)",
        "versions": C.versions(),
        "seconds": round(time.time() - t_start, 1),
        "per_chunk": per_chunk,
    }
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(res, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
