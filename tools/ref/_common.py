"""Shared helpers for the mlx-lm reference harness (tools/ref).

Everything here uses only mlx / mlx-lm / tokenizers: the reference must stay independent of the
Rust code it checks.
"""

from __future__ import annotations

import atexit
import datetime as _dt
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_map

# Files that may sit in a model folder as "pointer stubs": a tiny text file whose whole content is a
# relative path to the real file (the bundled assets/models/*/tokenizer*.json and
# chat_template.jinja are stored like that, pointing at ../../tokenizers/<family>/).
_POINTER_MAX_BYTES = 512


def _pointer_target(p: Path) -> Path | None:
    try:
        if p.is_symlink() or not p.is_file() or p.stat().st_size > _POINTER_MAX_BYTES:
            return None
        text = p.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None
    if not text or "\n" in text or text.startswith("{"):
        return None
    target = (p.parent / text).resolve()
    return target if target.is_file() else None


def resolve_model_dir(model_dir: str | os.PathLike) -> Path:
    """Return a folder mlx-lm can load.

    If the folder holds pointer stubs (see above), build a temporary folder of symlinks in which the
    stubs are replaced by links to their targets. The temporary folder is removed at exit.
    """
    src = Path(model_dir).resolve()
    if not (src / "config.json").is_file():
        raise SystemExit(f"{src}: no config.json")
    entries = sorted(p for p in src.iterdir() if p.is_file())
    pointers = {p.name: _pointer_target(p) for p in entries}
    if not any(pointers.values()):
        return src
    tmp = Path(tempfile.mkdtemp(prefix="mference-ref-model-"))
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)
    for p in entries:
        target = pointers[p.name] or p.resolve()
        (tmp / p.name).symlink_to(target)
    return tmp


def tokenizer_json_path(model_dir: str | os.PathLike) -> Path:
    d = resolve_model_dir(model_dir)
    p = d / "tokenizer.json"
    if not p.exists():
        raise SystemExit(f"{model_dir}: no tokenizer.json")
    return p.resolve()


def load_config(model_dir: str | os.PathLike) -> dict:
    with open(Path(model_dir) / "config.json") as f:
        return json.load(f)


def text_config(config: dict) -> dict:
    return config.get("text_config", config)


_LOW_PRECISION = (mx.bfloat16, mx.float16)


def cast_float_params_to_f32(model) -> int:
    """Cast every bf16/f16 parameter (norm weights, scalars, router scales, and the scales/biases of
    the quantized layers) to float32. Packed quantized weights (uint32) are left untouched, so the
    4-bit/8-bit weights are represented exactly: dequantised values are scale*q + bias, and bf16 ->
    f32 is exact. Returns the number of tensors cast."""
    n = 0

    def cast(p):
        nonlocal n
        if p.dtype in _LOW_PRECISION:
            n += 1
            return p.astype(mx.float32)
        return p

    model.update(tree_map(cast, model.parameters()))
    mx.eval(model.parameters())
    return n


def load_model_f32(model_dir: str | os.PathLike):
    """Load an MLX checkpoint with mlx-lm's own classes, cast to float32, and verify that a forward
    pass really produces float32 logits. Returns (model, config)."""
    from mlx_lm.utils import load_model

    d = resolve_model_dir(model_dir)
    model, config = load_model(d)
    n_cast = cast_float_params_to_f32(model)
    leftovers = sorted(
        {str(v.dtype) for _, v in tree_flatten(model.parameters())} - {"mlx.core.float32", "mlx.core.uint32"}
    )
    if leftovers:
        raise SystemExit(f"unexpected parameter dtypes after the f32 cast: {leftovers}")
    probe = model(mx.array([[text_config(config).get("bos_token_id", 0) or 0]]))
    mx.eval(probe)
    if probe.dtype != mx.float32:
        raise SystemExit(f"forward pass returned {probe.dtype}, expected float32")
    log(f"loaded {model_dir} ({config.get('model_type')}), cast {n_cast} tensors to float32; "
        f"forward dtype {probe.dtype}")
    return model, config


def forward_logits(model, ids, start: int = 0) -> mx.array:
    """One full-sequence forward pass, no cache. Returns [T - start, vocab] float32: the logits of
    positions start..T-1.

    With start > 0 the LM head (the most expensive op on CPU: [T, H] x [vocab, H] 4-bit) is applied
    to the needed rows only, by running mlx-lm's own sub-modules in the same order as
    gemma4_text.Model / qwen3_5.TextModel __call__ (checked against model() by check_split_head)."""
    x = mx.array(ids, dtype=mx.int32)[None]
    if start == 0:
        logits = model(x)[0]
    else:
        lm = getattr(model, "language_model", model)
        h = lm.model(x)[:, start:]
        tied = getattr(getattr(lm, "args", None), "tie_word_embeddings", False)
        logits = lm.model.embed_tokens.as_linear(h) if tied else lm.lm_head(h)
        cap = getattr(lm, "final_logit_softcapping", None)
        if cap is not None:
            softcap = getattr(sys.modules[type(lm).__module__], "logit_softcap", None)
            logits = softcap(cap, logits) if softcap else mx.tanh(logits / cap) * cap
        logits = logits[0]
    if logits.dtype != mx.float32:
        raise SystemExit(f"forward pass returned {logits.dtype}, expected float32")
    return logits


def check_split_head(model, ids) -> float:
    """Max |difference| between forward_logits(start=k) and model() on a short prefix."""
    ids = list(ids[:48])
    k = len(ids) // 2
    full = forward_logits(model, ids)[k:]
    part = forward_logits(model, ids, start=k)
    d = float(mx.max(mx.abs(full - part)).item())
    if d > 1e-4:
        raise SystemExit(f"split LM head disagrees with model(): max |diff| {d}")
    return d


def greedy(model, prompt_ids, n_new: int):
    """Greedy decode with mlx-lm's KV cache (make_prompt_cache): the whole prompt in one forward
    pass, then one token at a time. Returns the n_new generated ids."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    logits = model(mx.array(prompt_ids, dtype=mx.int32)[None], cache=cache)
    assert logits.dtype == mx.float32, logits.dtype
    out = []
    for _ in range(n_new):
        nxt = int(mx.argmax(logits[0, -1]).item())
        out.append(nxt)
        if len(out) == n_new:
            break
        logits = model(mx.array([[nxt]], dtype=mx.int32), cache=cache)
    return out


def versions() -> dict:
    import importlib.metadata as md

    out = {"python": sys.version.split()[0]}
    for pkg in ("mlx", "mlx-cpu", "mlx-lm", "numpy", "tokenizers", "transformers"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    return out


def now_utc() -> str:
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()


_T0 = time.time()


def log(msg: str) -> None:
    print(f"[{time.time() - _T0:7.1f}s] {msg}", file=sys.stderr, flush=True)


def read_token_file(path: str | os.PathLike) -> list[int]:
    """A JSON list of ints, or an object with a "tokens" (or "ids" / "prompt") list."""
    with open(path) as f:
        data = json.load(f)
    if isinstance(data, dict):
        for key in ("tokens", "ids", "prompt"):
            if key in data:
                data = data[key]
                break
        else:
            raise SystemExit(f"{path}: expected a list or an object with 'tokens'")
    ids = [int(x) for x in data]
    if not ids:
        raise SystemExit(f"{path}: empty token list")
    return ids


def np_f32(a: mx.array) -> np.ndarray:
    return np.asarray(a.astype(mx.float32))
