#!/usr/bin/env python3
"""Compute tools/ref/reference-values.json: mlx-lm float32 reference numbers for the bundled models.

    .venv/bin/python tools/ref/compute_reference_values.py [--models gemma4-tiny,qwen3_6-tiny] \
        [--shared-protocol] [--out tools/ref/reference-values.json]

Runs the harness CLIs (perplexity.py, encode.py, ref_logits.py) as subprocesses, so every value in
the JSON comes with the exact command line that produced it ($TMP = a scratch folder). Models
already in --out and not named in --models are kept as they are.

Per model:
  - perplexity, llama-perplexity protocol, first 8192 tokens of assets/austen_pride_and_prejudice.txt,
    ctx 512 (16 chunks x 255 scored predictions);
  - with --shared-protocol also the protocol of shared/models/*/README.md (20,000 tokens), to
    reproduce the model README's "4-bit, mlx-lm, fp32 compute" perplexity;
  - greedy 64-token continuation of "It is a truth universally acknowledged, that" (Gemma: with BOS)
    and of the chat render of user "Tell me about the weather in London." (template defaults, and for
    Gemma also enable_thinking=true, which is what mlx-lm's own generate/server pass);
  - comparison of the first 40 greedy ids with the README's "4-bit, mlx-lm, fp32 compute" ids.
"""

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
PY = ".venv/bin/python"
TEXT = "assets/austen_pride_and_prejudice.txt"
PROMPT = "It is a truth universally acknowledged, that"
CHAT_USER = "Tell me about the weather in London."

MODELS = {
    "gemma4-tiny": {
        "dir": "assets/models/gemma4-tiny",
        "bos": True,
        "readme_prompt_ids": [2, 1509, 563, 496, 9043, 69127, 30285, 236764, 600],
        "readme_fp32_greedy40": [625, 563, 711, 496, 107, 602, 602, 602, 602, 602, 742, 236764, 532, 625,
                                 563, 711, 496, 1822, 3772, 529, 506, 1902, 531, 577, 107, 602, 19178,
                                 236761, 138, 4573, 625, 563, 711, 496, 3210, 531, 577, 3028, 531, 1515],
        "readme_fp32_ppl_shared_protocol": 75.20,
        "chat_thinking": ["default", "true"],
    },
    "qwen3_6-tiny": {
        "dir": "assets/models/qwen3_6-tiny",
        "bos": False,
        "readme_prompt_ids": [2064, 369, 264, 7793, 58391, 24687, 11, 421],
        "readme_fp32_greedy40": [424, 369, 524, 279, 1788, 13, 198, 2064, 369, 524, 279, 1788, 3065, 421,
                                 369, 524, 279, 1788, 13, 198, 2064, 369, 524, 279, 1788, 3065, 421, 369,
                                 524, 279, 1788, 13, 198, 2064, 369, 524, 279, 1788, 3065, 421],
        "readme_fp32_ppl_shared_protocol": 67.64,
        "chat_thinking": ["default"],
    },
}


def run(cmd: list, tmp: Path) -> tuple[str, float]:
    shown = " ".join(shlex.quote(c) for c in cmd).replace(str(tmp), "$TMP")
    C.log(f"$ {shown}")
    t0 = time.time()
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    dt = time.time() - t0
    if p.returncode:
        sys.stderr.write(p.stderr)
        raise SystemExit(f"failed ({p.returncode}): {shown}")
    return shown, round(dt, 1)


def greedy_entry(model_dir: str, enc_args: list, n: int, tmp: Path, tag: str) -> dict:
    pf, gf = tmp / f"{tag}.prompt.json", tmp / f"{tag}.greedy.json"
    enc_cmd, _ = run([PY, "tools/ref/encode.py", "--model", model_dir, *enc_args, "--out", str(pf)], tmp)
    gen_cmd, secs = run([PY, "tools/ref/ref_logits.py", "--model", model_dir, "--tokens-file", str(pf),
                         "--greedy", str(n), "--greedy-out", str(gf)], tmp)
    enc = json.loads(pf.read_text())
    gen = json.loads(gf.read_text())
    return {"text": enc["text"], "prompt_ids": enc["prompt"], "generated_ids": gen["generated"],
            "commands": [enc_cmd, gen_cmd], "seconds": secs}


def do_model(name: str, spec: dict, tmp: Path, shared: bool, reuse_ppl: str | None) -> dict:
    d = spec["dir"]
    res = {"model_dir": d}

    out = tmp / f"{name}.ppl.json"
    cmd_list = [PY, "tools/ref/perplexity.py", "--model", d, "--file", TEXT, "--ctx", "512",
                "--max-tokens", "8192", "--json-out", str(out)]
    if reuse_ppl:  # the JSON that exactly this command wrote earlier (checked below)
        r = json.loads(Path(reuse_ppl).read_text())
        want = {"model": d, "file": TEXT, "ctx": 512, "max_tokens": 8192, "protocol": "llama"}
        assert all(r[k] == v for k, v in want.items()), (reuse_ppl, {k: r[k] for k in want})
        cmd = " ".join(shlex.quote(c) for c in cmd_list).replace(str(tmp), "$TMP")
        secs = r["seconds"]
    else:
        cmd, secs = run(cmd_list, tmp)
        r = json.loads(out.read_text())
    res["perplexity_llama_ctx512_8192"] = {
        "perplexity": r["perplexity"], "mean_nll": r["mean_nll"], "predictions": r["predictions"],
        "chunks": r["chunks"], "chunk_bos": r["chunk_bos"],
        "per_chunk_mean_nll": [c["nll_sum"] / c["n"] for c in r["per_chunk"]],
        "command": cmd, "seconds": secs,
    }
    if shared:
        out = tmp / f"{name}.ppl_shared.json"
        cmd, secs = run([PY, "tools/ref/perplexity.py", "--model", d, "--file", TEXT, "--ctx", "512",
                         "--max-tokens", "20000", "--protocol", "shared", "--json-out", str(out)], tmp)
        r = json.loads(out.read_text())
        res["perplexity_shared_protocol_20000"] = {
            "perplexity": r["perplexity"], "mean_nll": r["mean_nll"], "predictions": r["predictions"],
            "chunks": r["chunks"], "readme_value": spec["readme_fp32_ppl_shared_protocol"],
            "matches_readme_2dp": round(r["perplexity"], 2) == spec["readme_fp32_ppl_shared_protocol"],
            "command": cmd, "seconds": secs,
        }

    enc = ["--text", PROMPT] + (["--bos"] if spec["bos"] else [])
    g = greedy_entry(d, enc, 64, tmp, f"{name}.raw")
    g["prompt_matches_readme"] = g["prompt_ids"] == spec["readme_prompt_ids"]
    g["first40_match_readme_fp32"] = g["generated_ids"][:40] == spec["readme_fp32_greedy40"]
    res["greedy64_raw_prompt"] = g

    for th in spec["chat_thinking"]:
        key = "greedy64_chat" if th == "default" else f"greedy64_chat_enable_thinking_{th}"
        g = greedy_entry(d, ["--chat-user", CHAT_USER, "--thinking", th], 64, tmp, f"{name}.chat.{th}")
        g["messages"] = [{"role": "user", "content": CHAT_USER}]
        g["enable_thinking"] = "template default (not passed)" if th == "default" else th
        res[key] = g
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--shared-protocol", action="store_true")
    ap.add_argument("--out", default="tools/ref/reference-values.json")
    ap.add_argument("--reuse-ppl", help="(one model) reuse this perplexity.py --json-out result of the "
                    "default 8192/512 llama-protocol command instead of re-running it")
    a = ap.parse_args()
    out = REPO / a.out
    doc = json.loads(out.read_text()) if out.exists() else {}
    doc.setdefault("models", {})
    with tempfile.TemporaryDirectory(prefix="mference-refvals-") as t:
        tmp = Path(t)
        for name in a.models.split(","):
            doc["models"][name] = do_model(name, MODELS[name], tmp, a.shared_protocol, a.reuse_ppl)
            doc["models"][name]["date"] = C.now_utc()
            doc["models"][name]["versions"] = C.versions()
            doc["models"][name]["generated_by"] = " ".join(
                [PY, "tools/ref/compute_reference_values.py"] + sys.argv[1:])
    doc.pop("generated_by", None)
    doc["notes"] = [
        "All numbers: mlx-lm's own model classes, bf16 parameters cast to float32 after load (the stored "
        "4-bit/8-bit weights are used exactly), CPU.",
        "perplexity_llama_ctx512_8192: tools/ref/perplexity.py default protocol (llama-perplexity: chunks "
        "of ctx consecutive tokens of a stream that starts with BOS iff the tokenizer adds it, first token replaced by BOS iff the tokenizer adds "
        "BOS, positions ctx/2 .. ctx-2 scored against the next token).",
        "Greedy: argmax with mlx-lm's KV cache (prompt in one pass). Chat prompts are rendered by the "
        "folder's chat template through the transformers tokenizer (add_generation_prompt=True) and "
        "tokenized without adding special tokens.",
    ]
    out.write_text(json.dumps(doc, indent=1) + "\n")
    C.log(f"wrote {out}")


if __name__ == "__main__":
    main()
