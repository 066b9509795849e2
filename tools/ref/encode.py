#!/usr/bin/env python3
"""Token ids for a prompt, with the model folder's own tokenizer (reference side).

    .venv/bin/python tools/ref/encode.py --model DIR --text "It is a truth" [--bos] [--out F.json]
    .venv/bin/python tools/ref/encode.py --model DIR --chat-user "Tell me about the weather in London." [--out F.json]

--text: HF `tokenizers` on tokenizer.json with add_special_tokens=False; --bos prepends the
config's bos_token_id (Gemma: 2).
--chat-user: renders [{"role": "user", "content": ...}] with the folder's chat template through
mlx-lm's tokenizer loader (the transformers tokenizer's own apply_chat_template, tokenize=False,
add_generation_prompt=True, enable_thinking per --thinking, default: not passed), then tokenizes the rendered string with add_special_tokens=False (the
template itself writes <bos> for Gemma; no second BOS is added).
Writes {"prompt": [...], "text": <rendered or raw text>} (stdout unless --out).
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402


def render_chat(model_dir: str, user: str, thinking: str = "default") -> str:
    """thinking "default": the template's own default (enable_thinking not passed; HF
    apply_chat_template). "true"/"false": pass enable_thinking explicitly. NB: mlx-lm's
    TokenizerWrapper.apply_chat_template (mlx_lm.generate / mlx_lm.server) instead passes
    enable_thinking=True whenever the vocabulary has thinking tokens."""
    from mlx_lm.utils import load_tokenizer

    hf = load_tokenizer(C.resolve_model_dir(model_dir))._tokenizer
    kw = {} if thinking == "default" else {"enable_thinking": thinking == "true"}
    return hf.apply_chat_template([{"role": "user", "content": user}], tokenize=False,
                                  add_generation_prompt=True, **kw)


def encode(model_dir: str, text: str) -> list[int]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(C.tokenizer_json_path(model_dir)))
    return tok.encode(text, add_special_tokens=False).ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--text")
    g.add_argument("--chat-user")
    ap.add_argument("--thinking", choices=["default", "true", "false"], default="default",
                    help="--chat-user: enable_thinking for the template (default: not passed)")
    ap.add_argument("--bos", action="store_true", help="--text: prepend bos_token_id")
    ap.add_argument("--out")
    a = ap.parse_args()
    if a.chat_user is not None:
        text = render_chat(a.model, a.chat_user, a.thinking)
        ids = encode(a.model, text)
    else:
        text = a.text
        ids = encode(a.model, text)
        if a.bos:
            cfg = C.load_config(C.resolve_model_dir(a.model))
            bos = cfg.get("bos_token_id", C.text_config(cfg).get("bos_token_id"))
            if bos is None:
                raise SystemExit("--bos: config.json has no bos_token_id")
            ids = [bos] + ids
    out = json.dumps({"prompt": ids, "text": text}) + "\n"
    if a.out:
        Path(a.out).write_text(out)
    else:
        sys.stdout.write(out)


if __name__ == "__main__":
    main()
