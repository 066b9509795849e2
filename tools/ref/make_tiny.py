#!/usr/bin/env python3
"""Build a tiny RANDOM MoE checkpoint with mlx-lm's own model classes, quantized exactly like
`mlx_lm convert -q --q-bits 4 --q-group-size 64` (mlx_lm.utils.quantize_model with the model's default
quant_predicate), saved mlx-community style.

    .venv/bin/python tools/ref/make_tiny.py --family gemma4 --seed 1 --out /tmp/g4 \
        [--hidden 64 --layers 4 --layer-types SSSF --sliding-window 16 --experts 8 --top-k 2 ...]
    .venv/bin/python tools/ref/make_tiny.py --family qwen36 --seed 1 --out /tmp/q36 [--layer-types LLLF ...]

Output folder: config.json (with "quantization" and an identical "quantization_config"),
model.safetensors (metadata {"format": "mlx"}), model.safetensors.index.json, the family's tokenizer
files (tokenizer.json, tokenizer_config.json, chat_template.jinja, copied from
assets/tokenizers/<family>/) and make_tiny.json (the exact arguments, for provenance).

The same arguments and seed give bit-identical files. Weights are drawn with numpy (PCG64, seed) in
sorted parameter-name order, cast to bfloat16 (what convert does with dtype bfloat16), then quantized.
Every Linear whose input dimension is not a multiple of the group size stays bfloat16 (mlx-lm's
rule); the script warns when that happens.
"""

import argparse
import copy
import json
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from mlx.utils import tree_flatten, tree_unflatten  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def parse_layer_types(spec: str, n_layers: int, letters: dict) -> list:
    """'SSSF' / 'S,S,S,F' / full names; a pattern shorter than n_layers is repeated."""
    parts = [p for p in spec.replace(",", " ").split()] if ("," in spec or " " in spec) else list(spec)
    if len(parts) == 1 and parts[0] not in letters:
        parts = [parts[0]]
    names = []
    for p in parts:
        if p in letters:
            names.append(letters[p])
        elif p in letters.values():
            names.append(p)
        else:
            raise SystemExit(f"bad layer type {p!r}; use {sorted(letters)} or {sorted(letters.values())}")
    if len(names) != n_layers:
        if n_layers % len(names):
            raise SystemExit(f"--layer-types has {len(names)} entries, --layers is {n_layers}")
        names = names * (n_layers // len(names))
    return names


# ---------------------------------------------------------------------------------------------------
# Gemma 4 (model_type gemma4, language model in text_config), structure copied from
# assets/models/gemma4-tiny/config.json.

def gemma4_config(a) -> dict:
    layer_types = parse_layer_types(a.layer_types or "SSSF", a.layers,
                                    {"S": "sliding_attention", "F": "full_attention"})
    text = {
        "vocab_size": a.vocab_size,
        "hidden_size": a.hidden,
        "intermediate_size": a.intermediate,
        "num_hidden_layers": a.layers,
        "num_attention_heads": a.heads,
        "num_key_value_heads": a.kv_heads,
        "head_dim": a.head_dim,
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": a.max_pos,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-06,
        "use_cache": True,
        "pad_token_id": 0,
        "eos_token_id": 1,
        "bos_token_id": 2,
        "tie_word_embeddings": True,
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                               "rope_theta": 1000000.0},
        },
        "attention_bias": False,
        "attention_dropout": 0.0,
        "sliding_window": a.sliding_window,
        "layer_types": layer_types,
        "final_logit_softcapping": 30.0,
        "use_bidirectional_attention": None,
        "vocab_size_per_layer_input": a.vocab_size,
        "hidden_size_per_layer_input": 0,
        "attention_k_eq_v": not a.no_k_eq_v,
        "num_kv_shared_layers": 0,
        "enable_moe_block": True,
        "use_double_wide_mlp": False,
        "num_experts": a.experts,
        "top_k_experts": a.top_k,
        "moe_intermediate_size": a.moe_intermediate,
        "model_type": "gemma4_text",
        "dtype": "bfloat16",
        "global_head_dim": a.global_head_dim,
        "num_global_key_value_heads": a.global_kv_heads,
    }
    return {
        "architectures": ["Gemma4ForConditionalGeneration"],
        "bos_token_id": 2,
        "dtype": "bfloat16",
        "eos_token_id": [1, 106],
        "model_type": "gemma4",
        "pad_token_id": 0,
        "text_config": text,
        "tie_word_embeddings": True,
        "transformers_version": "5.17.0",
        "vocab_size": a.vocab_size,
    }


def gemma4_init(name: str, shape, rng, H: int) -> np.ndarray:
    n = int(np.prod(shape))
    if name.endswith("embed_tokens.weight"):
        # h0 = E[id] * sqrt(H) has RMS ~0.5, so the layers' post-normed outputs (RMS ~1 each) dominate
        # the residual stream and the tied head does not echo the input token (greedy would repeat).
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(0.5 / np.sqrt(H))
    if name == "language_model.model.norm.weight":
        # final norm around 5 compensates the small embedding: tied-head logits of std ~2.5
        return (5.0 + 0.3 * rng.standard_normal(shape)).astype(np.float32)
    if name.endswith("layer_scalar"):
        return rng.uniform(0.7, 1.3, size=shape).astype(np.float32)
    if name.endswith("router.scale"):
        return np.abs(1.0 + 0.25 * rng.standard_normal(shape)).astype(np.float32) + 0.05
    if name.endswith("router.per_expert_scale"):
        return rng.uniform(0.5, 1.5, size=shape).astype(np.float32)
    if len(shape) == 1:  # every RMSNorm weight (w-norm, weights around 1)
        return (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
    # Linear [out, in] or SwitchLinear [E, out, in]: N(0, 1/in)
    fan_in = shape[-1]
    del n
    return rng.standard_normal(shape, dtype=np.float32) * np.float32(1.0 / np.sqrt(fan_in))


def gemma4_expected_names(text: dict) -> set:
    P = "language_model.model."
    q = ("weight", "scales", "biases")
    names = {f"{P}embed_tokens.{s}" for s in q} | {f"{P}norm.weight"}
    for L, lt in enumerate(text["layer_types"]):
        p = f"{P}layers.{L}."
        projs = ["q_proj", "k_proj", "o_proj"]
        if not (text["attention_k_eq_v"] and lt == "full_attention"):
            projs.append("v_proj")
        for m in projs:
            names |= {f"{p}self_attn.{m}.{s}" for s in q}
        names |= {f"{p}self_attn.q_norm.weight", f"{p}self_attn.k_norm.weight"}
        for m in ("gate_proj", "up_proj", "down_proj"):
            names |= {f"{p}mlp.{m}.{s}" for s in q}
            names |= {f"{p}experts.switch_glu.{m}.{s}" for s in q}
        names |= {f"{p}router.proj.{s}" for s in q}
        names |= {f"{p}router.scale", f"{p}router.per_expert_scale", f"{p}layer_scalar"}
        for nrm in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                    "post_feedforward_layernorm", "pre_feedforward_layernorm_2",
                    "post_feedforward_layernorm_1", "post_feedforward_layernorm_2"):
            names.add(f"{p}{nrm}.weight")
    return names


def gemma4_check(weights: dict, config: dict, bits: int, gs: int) -> None:
    text = config["text_config"]
    want = gemma4_expected_names(text)
    have = set(weights)
    if have != want:
        raise SystemExit(f"tensor names differ from the Gemma 4 checkpoint layout (mlx-lm gemma4_text.py):\n  missing {sorted(want - have)}"
                         f"\n  unexpected {sorted(have - want)}")
    H, E, I = text["hidden_size"], text["num_experts"], text["moe_intermediate_size"]
    P = "language_model.model.layers."
    for L in range(text["num_hidden_layers"]):
        w = weights[f"{P}{L}.router.proj.weight"]
        assert w.dtype == mx.uint32 and tuple(w.shape) == (E, H * 8 // 32), (L, w.dtype, w.shape)
        g = weights[f"{P}{L}.experts.switch_glu.gate_proj.weight"]
        assert g.dtype == mx.uint32 and tuple(g.shape) == (E, I, H * bits // 32), (L, g.shape)
        d = weights[f"{P}{L}.experts.switch_glu.down_proj.weight"]
        assert tuple(d.shape) == (E, H, I * bits // 32), (L, d.shape)
        assert tuple(weights[f"{P}{L}.layer_scalar"].shape) == (1,)
        key = f"language_model.model.layers.{L}.router.proj"
        assert config["quantization"].get(key) == {"group_size": 64, "bits": 8}, key
    emb = weights["language_model.model.embed_tokens.weight"]
    assert tuple(emb.shape) == (text["vocab_size"], H * bits // 32), emb.shape


# ---------------------------------------------------------------------------------------------------
# Qwen 3.6 (model_type qwen3_5_moe, language model in text_config), structure copied from
# assets/models/qwen3_6-tiny/config.json.

def qwen36_config(a) -> dict:
    layer_types = parse_layer_types(a.layer_types or "LLLF", a.layers,
                                    {"L": "linear_attention", "F": "full_attention"})
    text = {
        "vocab_size": a.vocab_size,
        "hidden_size": a.hidden,
        "num_hidden_layers": a.layers,
        "num_attention_heads": a.heads,
        "num_key_value_heads": a.kv_heads,
        "hidden_act": "silu",
        "max_position_embeddings": a.max_pos,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-06,
        "use_cache": True,
        "tie_word_embeddings": False,
        "rope_parameters": {
            "rope_theta": 10000000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [3, 3, 2],
            "mrope_interleaved": True,
            "type": "default",
        },
        "attention_bias": False,
        "attention_dropout": 0.0,
        "head_dim": a.head_dim,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": a.linear_head_dim,
        "linear_value_head_dim": a.linear_head_dim,
        "linear_num_key_heads": a.linear_k_heads,
        "linear_num_value_heads": a.linear_v_heads,
        "moe_intermediate_size": a.moe_intermediate,
        "shared_expert_intermediate_size": a.intermediate,
        "num_experts_per_tok": a.top_k,
        "num_experts": a.experts,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
        "layer_types": layer_types,
        "pad_token_id": None,
        "bos_token_id": None,
        "eos_token_id": 248044,
        "partial_rotary_factor": 0.25,
        "model_type": "qwen3_5_moe_text",
        "dtype": "bfloat16",
        "full_attention_interval": 4,
    }
    return {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "dtype": "bfloat16",
        "eos_token_id": [248046, 248044],
        "model_type": "qwen3_5_moe",
        "text_config": text,
        "tie_word_embeddings": False,
        "transformers_version": "5.17.0",
    }


def qwen36_init(name: str, shape, rng, H: int) -> np.ndarray:
    if name.endswith("embed_tokens.weight"):
        return rng.standard_normal(shape, dtype=np.float32)  # no embedding scale in Qwen
    if name.endswith("lm_head.weight"):
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(3.0 / np.sqrt(H))
    if name.endswith("A_log"):  # g = -exp(A_log) * softplus(..): decay rates in a sane range
        return np.log(rng.uniform(0.5, 8.0, size=shape)).astype(np.float32)
    if name.endswith("dt_bias"):
        return (0.5 * rng.standard_normal(shape)).astype(np.float32)
    if name.endswith("conv1d.weight"):  # [C, K, 1] depthwise
        return (rng.standard_normal(shape) / np.sqrt(shape[1])).astype(np.float32)
    if len(shape) == 1:  # norms: MLX stores 1+w for zc-norms, and plain w for the gated norm
        return (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
    fan_in = shape[-1]
    return rng.standard_normal(shape, dtype=np.float32) * np.float32(1.0 / np.sqrt(fan_in))


def qwen36_check(weights: dict, config: dict, bits: int, gs: int) -> None:
    text = config["text_config"]
    P = "language_model.model.layers."
    for L, lt in enumerate(text["layer_types"]):
        p = f"{P}{L}."
        need = [f"{p}mlp.gate.weight", f"{p}mlp.shared_expert_gate.weight",
                f"{p}mlp.switch_mlp.gate_proj.weight", f"{p}mlp.shared_expert.down_proj.weight",
                f"{p}input_layernorm.weight", f"{p}post_attention_layernorm.weight"]
        if lt == "linear_attention":
            need += [f"{p}linear_attn.in_proj_qkv.weight", f"{p}linear_attn.conv1d.weight",
                     f"{p}linear_attn.A_log", f"{p}linear_attn.dt_bias", f"{p}linear_attn.norm.weight"]
        else:
            need += [f"{p}self_attn.q_proj.weight", f"{p}self_attn.q_norm.weight"]
        missing = [n for n in need if n not in weights]
        if missing:
            raise SystemExit(f"missing tensors (the Qwen 3.5 MoE layout of mlx-lm qwen3_5_moe.py): {missing}")
        for g in ("mlp.gate", "mlp.shared_expert_gate"):
            assert config["quantization"].get(f"language_model.model.layers.{L}.{g}") == \
                {"group_size": 64, "bits": 8}, (L, g)
    for n in ("language_model.model.embed_tokens.weight", "language_model.lm_head.weight",
              "language_model.model.norm.weight"):
        assert n in weights, n


FAMILIES = {
    "gemma4": dict(config=gemma4_config, init=gemma4_init, check=gemma4_check, tokenizer="gemma4",
                   defaults=dict(hidden=64, layers=4, heads=2, kv_heads=1, head_dim=32,
                                 global_head_dim=64, global_kv_heads=1, intermediate=128,
                                 moe_intermediate=64, experts=8, top_k=2, sliding_window=16,
                                 vocab_size=262144)),
    "qwen36": dict(config=qwen36_config, init=qwen36_init, check=qwen36_check, tokenizer="qwen3_6",
                   defaults=dict(hidden=64, layers=4, heads=2, kv_heads=1, head_dim=64,
                                 intermediate=64, moe_intermediate=64, experts=8, top_k=2,
                                 vocab_size=248320, linear_head_dim=32, linear_k_heads=2,
                                 linear_v_heads=4)),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", choices=sorted(FAMILIES), required=True)
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--out", required=True, help="output folder (must not exist unless --force)")
    ap.add_argument("--force", action="store_true", help="replace an existing --out folder")
    ap.add_argument("--hidden", type=int)
    ap.add_argument("--layers", type=int)
    ap.add_argument("--layer-types", help="gemma4: S/F per layer (e.g. SSSF, SFSF); "
                    "qwen36: L/F (e.g. LLLF); repeated to --layers if shorter")
    ap.add_argument("--sliding-window", type=int, help="gemma4 only")
    ap.add_argument("--experts", "--num-experts", dest="experts", type=int)
    ap.add_argument("--top-k", "--top-k-experts", dest="top_k", type=int)
    ap.add_argument("--moe-intermediate", "--moe-intermediate-size", dest="moe_intermediate", type=int)
    ap.add_argument("--intermediate", "--intermediate-size", dest="intermediate", type=int,
                    help="gemma4: dense shared MLP; qwen36: shared_expert_intermediate_size")
    ap.add_argument("--heads", type=int)
    ap.add_argument("--kv-heads", type=int, help="gemma4: sliding layers' KV heads")
    ap.add_argument("--head-dim", type=int)
    ap.add_argument("--global-head-dim", type=int, help="gemma4 full layers")
    ap.add_argument("--global-kv-heads", type=int, help="gemma4 full layers")
    ap.add_argument("--no-k-eq-v", action="store_true", help="gemma4: attention_k_eq_v false (v_proj everywhere)")
    ap.add_argument("--linear-head-dim", type=int, help="qwen36 GDN key/value head dim")
    ap.add_argument("--linear-k-heads", type=int, help="qwen36 GDN key heads")
    ap.add_argument("--linear-v-heads", type=int, help="qwen36 GDN value heads")
    ap.add_argument("--vocab-size", type=int)
    ap.add_argument("--max-pos", type=int, default=4096)
    ap.add_argument("--q-bits", type=int, default=4)
    ap.add_argument("--q-group-size", type=int, default=64)
    ap.add_argument("--no-tokenizer", action="store_true", help="do not copy tokenizer files")
    a = ap.parse_args()
    t0 = time.time()

    fam = FAMILIES[a.family]
    for k, v in fam["defaults"].items():
        if getattr(a, k, None) is None:
            setattr(a, k, v)
    out = Path(a.out)
    if out.exists():
        if not a.force:
            raise SystemExit(f"{out} exists (use --force)")
        shutil.rmtree(out)

    config = fam["config"](a)
    from mlx_lm.utils import _get_classes, quantize_model, save_config, save_model

    model_class, args_class = _get_classes(config=config)
    model = model_class(args_class.from_dict(copy.deepcopy(config)))
    cast_pred = getattr(model, "cast_predicate", lambda _: True)

    rng = np.random.Generator(np.random.PCG64(a.seed))
    H = a.hidden
    params = dict(tree_flatten(model.parameters()))
    new = []
    for name in sorted(params):
        shape = tuple(params[name].shape)
        w = fam["init"](name, shape, rng, H)
        assert w.shape == shape and w.dtype == np.float32, (name, w.shape, shape)
        arr = mx.array(w)
        if cast_pred(name):  # convert --dtype bfloat16 (qwen keeps A_log in f32)
            arr = arr.astype(mx.bfloat16)
        new.append((name, arr))
    model.update(tree_unflatten(new))
    mx.eval(model.parameters())

    # Which Linear-like modules will mlx-lm leave unquantized (input dim % group size != 0)?
    skipped = [p for p, m in model.named_modules()
               if hasattr(m, "to_quantized") and hasattr(m, "weight") and m.weight.shape[-1] % a.q_group_size]
    for p in skipped:
        C.log(f"WARNING: {p} (in dim not a multiple of {a.q_group_size}) stays bfloat16, as in mlx-lm")

    model, qconfig = quantize_model(model, config, a.q_group_size, a.q_bits, mode="affine")
    save_model(out, model)
    save_config(qconfig, config_path=out / "config.json")

    weights = mx.load(str(out / "model.safetensors"))
    fam["check"](weights, qconfig, a.q_bits, a.q_group_size)

    if not a.no_tokenizer:
        src = REPO / "assets" / "tokenizers" / fam["tokenizer"]
        for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            shutil.copyfile(src / f, out / f)
    with open(out / "make_tiny.json", "w") as f:
        json.dump({"argv": sys.argv[1:], "args": vars(a), "versions": C.versions()}, f, indent=1)
        f.write("\n")
    n_params = sum(v.size for v in params.values())
    C.log(f"wrote {out}: {a.family}, {n_params:,} parameters, {len(weights)} tensors, "
          f"layer_types {config['text_config']['layer_types']}, {time.time() - t0:.1f} s")


if __name__ == "__main__":
    main()
