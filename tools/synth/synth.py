#!/usr/bin/env python3
"""Full-size synthetic checkpoints for benchmarks: real tensor names, shapes, dtypes and quantization
overrides, random but well-formed values. Streams every tensor in row chunks (peak memory is a few
tens of MiB whatever the model size).

    # MLX (mlx-community layout: sharded safetensors + index, config.json, tokenizer files)
    .venv-bench/bin/python tools/synth/synth.py mlx  --model gemma4-26b --out work/g26-src
    # GGUF of the same shapes for llama.cpp: Q4_0 where MLX has 4-bit, Q8_0 where it has 8-bit
    .venv-bench/bin/python tools/synth/synth.py gguf --model gemma4-26b --out work/g26.gguf
    # the same at any size: --config takes a config.json (e.g. a tiny asset's) instead of a preset
    .venv-bench/bin/python tools/synth/synth.py mlx --config assets/models/gemma4-tiny/config.json --out /tmp/t

Presets: gemma4-26b (Gemma 4 26B-A4B), qwen36-35b (Qwen 3.6 35B-A3B), maple-preview (Maple
Preview 2-bit, ternary + FlashHead; the GGUF writer does not cover it), inkling-small
(Inkling-Small, MLX only; `--inkling-layers dsg` keeps a dense, a sliding MoE and a global MoE layer
at full width); shapes from the pinned checkpoints' config.json files (the presets in
crates/install/src/presets.rs name them) and the golden fixtures' configs under assets/fixtures/.

Values (why they keep activations finite through every layer):
- A quantized [out, in] weight gets uniform random codes; each group of 64 gets a scale
  sigma/std(codes) * U(0.75, 1.25) and a bias -scale * mean(code), so the dequantized weight has mean
  ~0 and std ~sigma, with sigma = 1/sqrt(in) (unit gain) as in tools/ref/make_tiny.py.
- Norm weights ~1 (+-0.1), Gemma layer scalars U(0.7, 1.0), router scales ~1, per-expert scales
  U(0.5, 1.5); Qwen A_log = log U(0.5, 8), dt_bias 0.5 N(0, 1), conv1d N(0, 1/4).
- Both families normalise before every projection, so the residual stream grows at most additively.
Q4_0 / Q8_0 blocks get the same sigma from random codes and one f16 scale per 32 weights.

Bit widths per weight: MLX affine 4-bit g64 with bf16 scale + bias = 4.5 bits; Q4_0 = 18 bytes per
32 = 4.5 bits. MLX 8-bit g64 = 8.5 bits; Q8_0 = 34 bytes per 32 = 8.5 bits. So both engines read the
same number of bytes per token (not the same bytes: the encodings differ).
"""

import argparse
import copy
import json
import os
import shutil
import struct
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
GS = 64  # MLX group size
CHUNK_BYTES = 32 << 20  # rows are generated this many packed bytes at a time
SHARD_BYTES = 5_000_000_000  # mlx-lm's default max shard size

# ------------------------------------------------------------------------------------------------
# Presets (HF text_config keys; the config layout mirrors assets/models/*-tiny/config.json)


def gemma4_26b() -> dict:
    L = 30
    types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(L)]
    text = json.loads((REPO / "assets/models/gemma4-tiny/config.json").read_text())["text_config"]
    text.update(vocab_size=262144, hidden_size=2816, intermediate_size=2112, num_hidden_layers=L,
                num_attention_heads=16, num_key_value_heads=8, head_dim=256, global_head_dim=512,
                num_global_key_value_heads=2, sliding_window=1024, layer_types=types,
                num_experts=128, top_k_experts=8, moe_intermediate_size=704,
                max_position_embeddings=262144, vocab_size_per_layer_input=262144)
    cfg = json.loads((REPO / "assets/models/gemma4-tiny/config.json").read_text())
    cfg["text_config"] = text
    return with_quant(cfg, [f"language_model.model.layers.{i}.router.proj" for i in range(L)])


def qwen36_35b() -> dict:
    L = 40
    types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(L)]
    cfg = json.loads((REPO / "assets/models/qwen3_6-tiny/config.json").read_text())
    text = cfg["text_config"]
    text.update(vocab_size=248320, hidden_size=2048, num_hidden_layers=L, num_attention_heads=16,
                num_key_value_heads=2, head_dim=256, linear_key_head_dim=128,
                linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=32,
                moe_intermediate_size=512, shared_expert_intermediate_size=512,
                num_experts_per_tok=8, num_experts=256, layer_types=types,
                max_position_embeddings=262144)
    text["rope_parameters"]["mrope_section"] = [11, 11, 10]
    return with_quant(cfg, [f"language_model.model.layers.{i}.mlp.{g}" for i in range(L)
                            for g in ("gate", "shared_expert_gate")])


def with_quant(cfg: dict, eight_bit: list) -> dict:
    q = {"group_size": GS, "bits": 4, "mode": "affine"}
    for p in eight_bit:
        q[p] = {"group_size": GS, "bits": 8}
    cfg["quantization"] = q
    cfg["quantization_config"] = copy.deepcopy(q)
    return cfg


def maple_preview() -> dict:
    """deepgrove/maple-preview-2bit-mlx (its config.json):
    fixture A's config (the pinned repo's keys) at the real shapes, with the real FlashHead block."""
    L = 24
    cfg = json.loads((REPO / "assets/fixtures/maple/A/checkpoint/config.json").read_text())
    cfg.update(vocab_size=151936, hidden_size=2048, intermediate_size=5120, num_hidden_layers=L,
               num_attention_heads=16, num_key_value_heads=4, head_dim=128, num_experts=256,
               num_experts_per_tok=8, moe_intermediate_size=512,
               moe_shared_expert_intermediate_size=512, sliding_window=512,
               max_position_embeddings=128000, eos_token_id=151645,
               layer_types=["full_attention" if (i + 1) % 4 == 0 else "sliding_attention"
                            for i in range(L)],
               flash_head={"n_clusters": 4748, "cluster_size": 32, "n_probes": 512,
                           "group_size": 64, "bits": 4, "head_group_size": 64, "head_bits": 4,
                           "scaled_centroids": True, "force_tokens": [151645, 151668, 151643]})
    return cfg


def inkling_small() -> dict:
    """pipenetwork/Inkling-Small-MLX-4bit (its config.json): the checkpoint's own
    keys (intermediate_size = expert width), towers left out (the installer skips them)."""
    L = 42
    cfg = json.loads((REPO / "assets/fixtures/inkling/A/checkpoint/config.json").read_text())
    cfg["text_config"].update(
        hidden_size=4096, num_hidden_layers=L, vocab_size=201024, unpadded_vocab_size=200058,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, swa_num_attention_heads=32,
        swa_num_key_value_heads=8, swa_head_dim=128, sliding_window_size=512, d_rel=16,
        rel_extent=1024, log_scaling_n_floor=128000, log_scaling_alpha=0.1, dense_mlp_idx=2,
        dense_intermediate_size=16384, intermediate_size=2048, n_routed_experts=256,
        num_experts_per_tok=6, n_shared_experts=2, route_scale=8.0,
        local_layer_ids=[i for i in range(L) if i % 6 != 5])
    cfg.pop("vision_config", None)
    cfg.pop("audio_config", None)
    cfg["quantization"] = {"group_size": GS, "bits": 4, "recipe": "uniform"}
    return cfg


def inkling_layers(cfg: dict, spec: str) -> dict:
    """Truncates an Inkling config to the layers `spec` spells, one letter each: d = dense
    (sliding), s = MoE sliding, g = MoE global; dense layers first (e.g. `dsg`)."""
    if not spec or any(c not in "dsg" for c in spec) or "d" in spec.lstrip("d"):
        raise SystemExit(f"--inkling-layers {spec!r}: letters d, s, g with the d's first")
    t = cfg["text_config"]
    t.update(num_hidden_layers=len(spec), dense_mlp_idx=len(spec) - len(spec.lstrip("d")),
             local_layer_ids=[i for i, c in enumerate(spec) if c != "g"])
    return cfg


PRESETS = {"gemma4-26b": gemma4_26b, "qwen36-35b": qwen36_35b, "maple-preview": maple_preview,
           "inkling-small": inkling_small}

# ------------------------------------------------------------------------------------------------
# Tensor plans. A plan entry: (module_or_tensor_name, kind, shape, init) where kind is "q" (a
# quantized Linear [.., out, in], expands to .weight/.scales/.biases) or a dtype "BF16"/"F32";
# init is a dict telling the value generator what to draw.


def bits_of(cfg: dict, module: str) -> int:
    if module.startswith("lm_head_flash."):
        return cfg["flash_head"]["bits"]
    o = cfg["quantization"].get(module)
    return o["bits"] if isinstance(o, dict) else cfg["quantization"]["bits"]


def gemma4_plan(cfg: dict) -> list:
    t = cfg["text_config"]
    H, V, I = t["hidden_size"], t["vocab_size"], t["intermediate_size"]
    E, Im = t["num_experts"], t["moe_intermediate_size"]
    nh = t["num_attention_heads"]
    P = "language_model.model."
    plan = [(P + "embed_tokens", "q", (V, H), dict(sigma=1.0 / np.sqrt(H))),
            (P + "norm.weight", "BF16", (H,), dict(const=2.5, noise=0.2))]
    for L, lt in enumerate(t["layer_types"]):
        p = f"{P}layers.{L}."
        full = lt == "full_attention"
        hd = t["global_head_dim"] if full else t["head_dim"]
        nkv = t["num_global_key_value_heads"] if full else t["num_key_value_heads"]
        a = p + "self_attn."
        plan += [(a + "q_proj", "q", (nh * hd, H), {}), (a + "k_proj", "q", (nkv * hd, H), {})]
        if not (full and t["attention_k_eq_v"]):
            plan.append((a + "v_proj", "q", (nkv * hd, H), {}))
        plan += [(a + "o_proj", "q", (H, nh * hd), {}),
                 (a + "q_norm.weight", "BF16", (hd,), {}), (a + "k_norm.weight", "BF16", (hd,), {})]
        for m, shp in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
            plan.append((f"{p}mlp.{m}", "q", shp, {}))
        for m, shp in (("gate_proj", (E, Im, H)), ("up_proj", (E, Im, H)), ("down_proj", (E, H, Im))):
            plan.append((f"{p}experts.switch_glu.{m}", "q", shp, {}))
        plan += [(p + "router.proj", "q", (E, H), {}),
                 (p + "router.scale", "BF16", (H,), dict(const=1.0, noise=0.25, abs=0.05)),
                 (p + "router.per_expert_scale", "BF16", (E,), dict(uniform=(0.5, 1.5))),
                 (p + "layer_scalar", "BF16", (1,), dict(uniform=(0.7, 1.0)))]
        for n in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                  "post_feedforward_layernorm", "pre_feedforward_layernorm_2",
                  "post_feedforward_layernorm_1", "post_feedforward_layernorm_2"):
            plan.append((f"{p}{n}.weight", "BF16", (H,), {}))
    return plan


def qwen36_plan(cfg: dict) -> list:
    t = cfg["text_config"]
    H, V = t["hidden_size"], t["vocab_size"]
    E, Im, Is = t["num_experts"], t["moe_intermediate_size"], t["shared_expert_intermediate_size"]
    nh, nkv, hd = t["num_attention_heads"], t["num_key_value_heads"], t["head_dim"]
    kh, vh = t["linear_num_key_heads"], t["linear_num_value_heads"]
    kd, vd = t["linear_key_head_dim"], t["linear_value_head_dim"]
    conv = 2 * kh * kd + vh * vd
    P = "language_model.model."
    plan = [(P + "embed_tokens", "q", (V, H), dict(sigma=1.0)),
            ("language_model.lm_head", "q", (V, H), dict(sigma=3.0 / np.sqrt(H))),
            (P + "norm.weight", "BF16", (H,), {})]
    for L, lt in enumerate(t["layer_types"]):
        p = f"{P}layers.{L}."
        if lt == "linear_attention":
            a = p + "linear_attn."
            plan += [(a + "in_proj_qkv", "q", (conv, H), {}), (a + "in_proj_z", "q", (vh * vd, H), {}),
                     (a + "in_proj_a", "q", (vh, H), {}), (a + "in_proj_b", "q", (vh, H), {}),
                     (a + "out_proj", "q", (H, vh * vd), {}),
                     (a + "conv1d.weight", "BF16", (conv, t["linear_conv_kernel_dim"], 1),
                      dict(const=0.0, noise=0.5)),
                     (a + "A_log", "F32", (vh,), dict(log_uniform=(0.5, 8.0))),
                     (a + "dt_bias", "BF16", (vh,), dict(const=0.0, noise=0.5)),
                     (a + "norm.weight", "BF16", (vd,), {})]
        else:
            a = p + "self_attn."
            plan += [(a + "q_proj", "q", (2 * nh * hd, H), {}), (a + "k_proj", "q", (nkv * hd, H), {}),
                     (a + "v_proj", "q", (nkv * hd, H), {}), (a + "o_proj", "q", (H, nh * hd), {}),
                     (a + "q_norm.weight", "BF16", (hd,), {}), (a + "k_norm.weight", "BF16", (hd,), {})]
        m = p + "mlp."
        plan += [(m + "gate", "q", (E, H), {}), (m + "shared_expert_gate", "q", (1, H), {})]
        for n, shp in (("gate_proj", (E, Im, H)), ("up_proj", (E, Im, H)), ("down_proj", (E, H, Im))):
            plan.append((f"{m}switch_mlp.{n}", "q", shp, {}))
        for n, shp in (("gate_proj", (Is, H)), ("up_proj", (Is, H)), ("down_proj", (H, Is))):
            plan.append((f"{m}shared_expert.{n}", "q", shp, {}))
        plan += [(p + "input_layernorm.weight", "BF16", (H,), {}),
                 (p + "post_attention_layernorm.weight", "BF16", (H,), {})]
    return plan


def maple_plan(cfg: dict) -> list:
    """Maple: ternary ("t": 2-bit codes in {0,1,2} + a BF16 row_alpha per output row) attention and
    experts, BF16 router, 4-bit g64 embedding and head, and the FlashHead tensors. The synthetic
    FlashHead clusters are the vocabulary in order (token_map = arange), so the cluster-ordered head
    copy is lm_head's bytes (same stream); the centroids are random: a speed fixture only."""
    H, V = cfg["hidden_size"], cfg["vocab_size"]
    E, Im = cfg["num_experts"], cfg["moe_intermediate_size"]
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    plan = [("model.word_embeddings", "q", (V, H), dict(sigma=1.0)),
            ("lm_head", "q", (V, H), dict(sigma=3.0 / np.sqrt(H))),
            ("model.norm.weight", "BF16", (H,), {})]
    f = cfg.get("flash_head")
    if f:
        nc, cs = f["n_clusters"], f["cluster_size"]
        assert nc * cs == V, "the synthetic FlashHead clusters the vocabulary in order"
        plan += [("lm_head_flash.centroids", "q", (nc, H), dict(sigma=3.0 / np.sqrt(H))),
                 ("lm_head_flash.head", "q", (nc, cs, H), dict(sigma=3.0 / np.sqrt(H),
                                                               stream="lm_head")),
                 ("lm_head_flash.token_map", "I32", (nc, cs), dict(arange=True))]
    for L in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{L}."
        a = p + "self_attn."
        plan += [(a + "q_proj", "t", (nh * hd, H), {}), (a + "k_proj", "t", (nkv * hd, H), {}),
                 (a + "v_proj", "t", (nkv * hd, H), {}), (a + "o_proj", "t", (H, nh * hd), {}),
                 (a + "q_norm.weight", "BF16", (hd,), {}), (a + "k_norm.weight", "BF16", (hd,), {}),
                 (p + "mlp.gate.weight", "BF16", (E, H), dict(const=0.0, noise=1.0 / np.sqrt(H)))]
        for n, shp in (("gate_proj", (E, Im, H)), ("up_proj", (E, Im, H)), ("down_proj", (E, H, Im))):
            plan.append((f"{p}mlp.switch_mlp.{n}", "t", shp, {}))
        plan += [(p + "input_layernorm.weight", "BF16", (H,), {}),
                 (p + "post_attention_layernorm.weight", "BF16", (H,), {})]
    return plan


def ternary_codes(n_bytes: int, noise) -> np.ndarray:
    """Packed 2-bit codes in {0, 1, 2} (a 3 becomes 1, i.e. weight 0): P(0) = P(2) = 1/4."""
    b = noise.bytes(n_bytes)
    both = (b & 0xAA) & ((b & 0x55) << 1)
    return b & ~both


def inkling_plan(cfg: dict) -> list:
    """model.llm.* tensors as inkling-mlx's converter writes them (pipenetwork/Inkling-Small-MLX-4bit's names):
    router, norms, short convolutions and rel_logits_proj unquantized; router bias and
    global_scale F32, the dense global_scale BF16."""
    t = cfg["text_config"]
    H, V, K = t["hidden_size"], t["vocab_size"], t["sconv_kernel_size"]
    E, S, I, DI = t["n_routed_experts"], t["n_shared_experts"], t["intermediate_size"], \
        t["dense_intermediate_size"]
    P = "model.llm."
    plan = [(P + "embed", "q", (V, H), dict(sigma=1.0)),
            (P + "embed_norm.weight", "BF16", (H,), {}),
            (P + "unembed", "q", (V, H), dict(sigma=16.0 / np.sqrt(H))),
            (P + "norm.weight", "BF16", (H,), {})]
    conv = dict(const=0.0, noise=0.1)
    for L in range(t["num_hidden_layers"]):
        sliding = L in t["local_layer_ids"]
        nh = t["swa_num_attention_heads"] if sliding else t["num_attention_heads"]
        nkv = t["swa_num_key_value_heads"] if sliding else t["num_key_value_heads"]
        hd = t["swa_head_dim"] if sliding else t["head_dim"]
        extent = t["sliding_window_size"] if sliding else t["rel_extent"]
        p = f"{P}layers.{L}."
        a = p + "attn."
        plan += [(a + "wq_du", "q", (nh * hd, H), {}), (a + "wk_dv", "q", (nkv * hd, H), {}),
                 (a + "wv_dv", "q", (nkv * hd, H), {}), (a + "wr_du", "q", (nh * t["d_rel"], H), {}),
                 (a + "wo_ud", "q", (H, nh * hd), {}),
                 (a + "q_norm.weight", "BF16", (hd,), {}), (a + "k_norm.weight", "BF16", (hd,), {}),
                 (a + "k_sconv.weight", "BF16", (nkv * hd, K, 1), conv),
                 (a + "v_sconv.weight", "BF16", (nkv * hd, K, 1), conv),
                 (a + "rel_logits_proj.proj", "BF16", (t["d_rel"], extent), dict(const=0.0, noise=0.5)),
                 (p + "attn_sconv.weight", "BF16", (H, K, 1), conv),
                 (p + "mlp_sconv.weight", "BF16", (H, K, 1), conv),
                 (p + "attn_norm.weight", "BF16", (H,), {}), (p + "mlp_norm.weight", "BF16", (H,), {})]
        m = p + "mlp."
        if L < t["dense_mlp_idx"]:
            plan += [(m + "gate_proj", "q", (DI, H), {}), (m + "up_proj", "q", (DI, H), {}),
                     (m + "down_proj", "q", (H, DI), {}),
                     (m + "global_scale", "BF16", (1,), dict(const=1.0, noise=0.2))]
            continue
        plan += [(m + "gate.weight", "BF16", (E + S, H), dict(const=0.0, noise=1.0 / np.sqrt(H))),
                 (m + "gate.bias", "F32", (E,), dict(const=0.0, noise=0.05)),
                 (m + "gate.global_scale", "F32", (1,), dict(const=1.0, noise=0.2))]
        for group, n in (("experts", E), ("shared_experts", S)):
            for name, shp in (("gate_proj", (n, I, H)), ("up_proj", (n, I, H)), ("down_proj", (n, H, I))):
                plan.append((f"{m}{group}.{name}", "q", shp, {}))
    return plan


def family(cfg: dict) -> str:
    mt = cfg["model_type"]
    if mt == "maple":
        return "maple"
    if mt.startswith("gemma4"):
        return "gemma4"
    if mt.startswith("qwen3_5_moe"):
        return "qwen36"
    if mt == "inkling_mm_model":
        return "inkling"
    raise SystemExit(f"unsupported model_type {mt!r} (gemma4, qwen3_5_moe, inkling_mm_model)")


def plan_of(cfg: dict) -> list:
    return {"gemma4": gemma4_plan, "qwen36": qwen36_plan, "maple": maple_plan,
            "inkling": inkling_plan}[family(cfg)](cfg)


# ------------------------------------------------------------------------------------------------
# Value generation (numpy PCG64, per-tensor seeds so any tensor can be regenerated alone)


def bf16_bytes(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 (round to nearest even), as little-endian uint16."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def small_values(shape, init: dict, rng) -> np.ndarray:
    n = int(np.prod(shape))
    if "uniform" in init:
        v = rng.uniform(*init["uniform"], size=n)
    elif "log_uniform" in init:
        v = np.log(rng.uniform(*init["log_uniform"], size=n))
    else:
        v = init.get("const", 1.0) + init.get("noise", 0.1) * rng.standard_normal(n)
        if "abs" in init:
            v = np.abs(v) + init["abs"]
    return v.astype(np.float32)


def code_stats(bits: int):
    """Mean and std of a uniform code in [0, 2^bits)."""
    n = 1 << bits
    return (n - 1) / 2.0, np.sqrt((n * n - 1) / 12.0)


class Noise:
    """Fast well-spread random bytes: one pool drawn from the tensor's PCG64 stream, then every
    request is a window of the pool at a random 8-byte offset XORed with a random 64-bit key.
    (numpy's own generators run at tens of MB/s on a busy 2-core host; this runs at memory speed,
    and the values only need to be well spread, not statistically independent.)"""

    POOL = 8 << 20

    def __init__(self, rng):
        self.rng = rng
        self.pool = np.frombuffer(rng.bytes(self.POOL + 8), dtype=np.uint64)

    def u64(self, n: int) -> np.ndarray:
        out = np.empty(n, dtype=np.uint64)
        words = self.POOL // 8
        for i in range(0, n, words):
            m = min(words, n - i)
            off = int(self.rng.integers(0, words - m + 1))
            np.bitwise_xor(self.pool[off:off + m], np.uint64(self.rng.integers(0, 2**63)) * np.uint64(2) + np.uint64(1), out=out[i:i + m])
        return out

    def bytes(self, n: int) -> np.ndarray:
        return self.u64((n + 7) // 8).view(np.uint8)[:n]

    def uniform(self, shape, lo: float, hi: float) -> np.ndarray:
        n = int(np.prod(shape))
        u = self.u64((n + 3) // 4).view(np.uint16)[:n].astype(np.float32) * np.float32(1.0 / 65536)
        return (lo + (hi - lo) * u).reshape(shape)


def mlx_codes(rows: int, cols: int, bits: int, noise: Noise) -> np.ndarray:
    """Packed uniform codes of one chunk of rows (little-endian u32 words, as bytes)."""
    return noise.bytes(rows * cols * bits // 8)


def mlx_scales_biases(rows: int, cols: int, bits: int, sigma: float, noise: Noise):
    """bf16 scales and biases of one chunk of rows: dequantized weights have mean ~0, std ~sigma."""
    mean, std = code_stats(bits)
    s = np.float32(sigma / std) * noise.uniform((rows, cols // GS), 0.75, 1.25)
    b = -s * np.float32(mean) + np.float32(0.02 * sigma) * noise.uniform((rows, cols // GS), -1.0, 1.0)
    return bf16_bytes(s), bf16_bytes(b)


def chunk_rows(total_rows: int, row_bytes: int):
    step = max(1, CHUNK_BYTES // max(row_bytes, 1))
    for r0 in range(0, total_rows, step):
        yield r0, min(step, total_rows - r0)


def seed_of(base: int, name: str) -> int:
    h = 1469598103934665603
    for c in name.encode():
        h = ((h ^ c) * 1099511628211) & ((1 << 64) - 1)
    return (h ^ base) & ((1 << 63) - 1)


# ------------------------------------------------------------------------------------------------
# MLX safetensors writer


def mlx_tensors(plan: list, cfg: dict):
    """(name, dtype, shape, nbytes, writer) for every safetensors tensor, sorted by name as mlx-lm
    writes them; writer(seed) yields byte chunks in order."""
    out = []
    for name, kind, shape, init in plan:
        if kind == "t":
            *lead, rows_out, cols = shape
            nrows = int(np.prod(lead, dtype=np.int64)) * rows_out
            # w = a·(q − 1) has std a/sqrt(2): a = sqrt(2)/sqrt(in) for unit gain.
            alpha = np.sqrt(2.0 / cols)

            def w(seed, nrows=nrows, cols=cols, name=name):
                noise = Noise(np.random.default_rng(seed_of(seed, name + ".weight")))
                for _, n in chunk_rows(nrows, cols // 4):
                    yield ternary_codes(n * cols // 4, noise).tobytes()

            def a(seed, nrows=nrows, alpha=alpha, name=name):
                noise = Noise(np.random.default_rng(seed_of(seed, name + ".row_alpha")))
                yield bf16_bytes(np.float32(alpha) * noise.uniform((nrows,), 0.75, 1.25)).tobytes()
            out.append((f"{name}.weight", "U32", list(lead) + [rows_out, cols // 16],
                        nrows * cols // 4, w))
            out.append((f"{name}.row_alpha", "BF16", list(lead) + [rows_out], nrows * 2, a))
            continue
        if kind != "q":
            dt = kind
            nbytes = int(np.prod(shape)) * (4 if dt in ("F32", "I32") else 2)

            def w(seed, shape=shape, init=init, dt=dt, name=name):
                if dt == "I32":
                    yield np.arange(int(np.prod(shape)), dtype="<i4").tobytes()
                    return
                v = small_values(shape, init, np.random.default_rng(seed_of(seed, name)))
                yield (v.tobytes() if dt == "F32" else bf16_bytes(v).tobytes())
            out.append((name, dt, list(shape), nbytes, w))
            continue
        bits = bits_of(cfg, name)
        *lead, rows_out, cols = shape
        if cols % GS:
            raise SystemExit(f"{name}: in dim {cols} is not a multiple of {GS}")
        nrows = int(np.prod(lead, dtype=np.int64)) * rows_out
        sigma = init.get("sigma", 1.0 / np.sqrt(cols))
        stream = init.get("stream", name)
        # Codes and scales/biases come from separate streams, so each tensor is generated alone.
        for part, dt, last, per_row in (("weight", "U32", cols * bits // 32, cols * bits // 8),
                                        ("scales", "BF16", cols // GS, cols // GS * 2),
                                        ("biases", "BF16", cols // GS, cols // GS * 2)):
            def w(seed, part=part, nrows=nrows, cols=cols, bits=bits, sigma=sigma, name=stream):
                if part == "weight":
                    noise = Noise(np.random.default_rng(seed_of(seed, name + ".weight")))
                    for _, n in chunk_rows(nrows, cols * bits // 8):
                        yield mlx_codes(n, cols, bits, noise).tobytes()
                    return
                noise = Noise(np.random.default_rng(seed_of(seed, name + ".scales_biases")))
                for _, n in chunk_rows(nrows, cols // GS * 8):
                    s, b = mlx_scales_biases(n, cols, bits, sigma, noise)
                    yield (s if part == "scales" else b).tobytes()
            out.append((f"{name}.{part}", dt, list(lead) + [rows_out, last], nrows * per_row, w))
    out.sort(key=lambda x: x[0])
    return out


def write_mlx(cfg: dict, out: Path, seed: int, tokenizer: bool) -> None:
    tensors = mlx_tensors(plan_of(cfg), cfg)
    shards, cur, size = [], [], 0
    for t in tensors:
        if cur and size + t[3] > SHARD_BYTES:
            shards.append(cur)
            cur, size = [], 0
        cur.append(t)
        size += t[3]
    shards.append(cur)
    total = sum(t[3] for t in tensors)
    check_disk(out.parent if out.parent.exists() else Path("."), total)
    tmp = out.with_name(out.name + ".partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    weight_map, t0, done = {}, time.time(), 0
    for i, shard in enumerate(shards):
        fname = ("model.safetensors" if len(shards) == 1
                 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors")
        header, off = {"__metadata__": {"format": "mlx"}}, 0
        for name, dt, shape, nbytes, _ in shard:
            header[name] = {"dtype": dt, "shape": shape, "data_offsets": [off, off + nbytes]}
            off += nbytes
            weight_map[name] = fname
        hb = json.dumps(header, separators=(",", ":")).encode()
        hb += b" " * (-len(hb) % 8)
        with open(tmp / fname, "wb") as f:
            f.write(struct.pack("<Q", len(hb)) + hb)
            for name, _, _, nbytes, w in shard:
                n = 0
                for chunk in w(seed):
                    f.write(chunk)
                    n += len(chunk)
                assert n == nbytes, (name, n, nbytes)
                done += nbytes
                progress(done, total, t0)
    (tmp / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=4) + "\n")
    (tmp / "config.json").write_text(json.dumps(cfg, indent=4) + "\n")
    if tokenizer:
        src = REPO / "assets/tokenizers" / {"gemma4": "gemma4", "qwen36": "qwen3_6",
                                             "maple": "maple", "inkling": "inkling"}[family(cfg)]
        for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            shutil.copyfile(src / f, tmp / f)
    (tmp / "synth.json").write_text(json.dumps({"argv": sys.argv[1:], "seed": seed,
                                                "total_bytes": total}, indent=1) + "\n")
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    print(f"\nwrote {out}: {len(tensors)} tensors in {len(shards)} shard(s), {total:,} bytes, "
          f"{time.time() - t0:.0f} s", file=sys.stderr)


# ------------------------------------------------------------------------------------------------
# GGUF writer (names and metadata as the vendored llama.cpp's conversion/gemma.py and
# src/models/{gemma4,qwen35moe}.cpp read them)

Q4_0_BLOCK, Q8_0_BLOCK = 18, 34  # bytes per 32 weights


def ggml_rows(rows: int, cols: int, bits: int, sigma: float, noise: Noise) -> np.ndarray:
    """One chunk of a Q4_0 (bits 4) or Q8_0 (bits 8) matrix: per 32 weights an f16 scale d and
    codes whose dequantized value d*(q-8) / d*q has std sigma."""
    nb = rows * cols // 32
    bsz = Q4_0_BLOCK if bits == 4 else Q8_0_BLOCK
    std = np.sqrt((16 * 16 - 1) / 12.0) if bits == 4 else np.sqrt((256 * 256 - 1) / 12.0)
    blk = noise.bytes(nb * bsz).reshape(nb, bsz).copy()
    d = (np.float32(sigma / std) * noise.uniform(nb, 0.75, 1.25)).astype(np.float16)
    blk[:, :2] = d.view(np.uint8).reshape(nb, 2)
    return blk


def gguf_plan(cfg: dict) -> tuple:
    """(arch, kv list, tensor list) for the GGUF of `cfg`. A tensor: (gguf_name, mlx_module, kind,
    numpy-order shape, init) with kind "q4"/"q8"/"F32"."""
    fam = family(cfg)
    t = cfg["text_config"]
    plan = plan_of(cfg)
    by = {name: (kind, shape, init) for name, kind, shape, init in plan}
    tensors = []

    def add(gname, mname, kind=None, shape=None, init=None):
        k, s, i = by[mname]
        if k == "q":
            k = "q4" if bits_of(cfg, mname) == 4 else "q8"
        else:
            k = "F32"
        tensors.append((gname, mname, kind or k, tuple(shape or s), init if init is not None else i))

    P = "language_model.model."
    if fam == "gemma4":
        add("token_embd.weight", P + "embed_tokens")
        add("output_norm.weight", P + "norm.weight")
        ghd = t["global_head_dim"]
        n_rot = int(ghd * t["rope_parameters"]["full_attention"]["partial_rotary_factor"] / 2)
        tensors.append(("rope_freqs.weight", None, "F32", (ghd // 2,),
                        dict(values=[1.0] * n_rot + [1e30] * (ghd // 2 - n_rot))))
        for L, lt in enumerate(t["layer_types"]):
            p, b = f"{P}layers.{L}.", f"blk.{L}."
            a = p + "self_attn."
            add(b + "attn_norm.weight", p + "input_layernorm.weight")
            add(b + "attn_q.weight", a + "q_proj")
            add(b + "attn_k.weight", a + "k_proj")
            if a + "v_proj" in by:
                add(b + "attn_v.weight", a + "v_proj")
            add(b + "attn_output.weight", a + "o_proj")
            add(b + "attn_q_norm.weight", a + "q_norm.weight")
            add(b + "attn_k_norm.weight", a + "k_norm.weight")
            add(b + "post_attention_norm.weight", p + "post_attention_layernorm.weight")
            add(b + "layer_output_scale.weight", p + "layer_scalar")
            add(b + "ffn_norm.weight", p + "pre_feedforward_layernorm.weight")
            for g, m in (("ffn_gate", "gate_proj"), ("ffn_up", "up_proj"), ("ffn_down", "down_proj")):
                add(f"{b}{g}.weight", f"{p}mlp.{m}")
                add(f"{b}{g}_exps.weight", f"{p}experts.switch_glu.{m}")
            add(b + "post_ffw_norm.weight", p + "post_feedforward_layernorm.weight")
            add(b + "ffn_gate_inp.weight", p + "router.proj")
            add(b + "ffn_gate_inp.scale", p + "router.scale")
            add(b + "ffn_down_exps.scale", p + "router.per_expert_scale")
            add(b + "pre_ffw_norm_2.weight", p + "pre_feedforward_layernorm_2.weight")
            add(b + "post_ffw_norm_1.weight", p + "post_feedforward_layernorm_1.weight")
            add(b + "post_ffw_norm_2.weight", p + "post_feedforward_layernorm_2.weight")
        swa = [x == "sliding_attention" for x in t["layer_types"]]
        rp = t["rope_parameters"]
        kv = [("context_length", "u32", t["max_position_embeddings"]),
              ("embedding_length", "u32", t["hidden_size"]),
              ("block_count", "u32", t["num_hidden_layers"]),
              ("feed_forward_length", "u32", t["intermediate_size"]),
              ("attention.head_count", "u32", t["num_attention_heads"]),
              ("attention.head_count_kv", "arr_i32",
               [t["num_key_value_heads"] if s else t["num_global_key_value_heads"] for s in swa]),
              ("attention.layer_norm_rms_epsilon", "f32", t["rms_norm_eps"]),
              ("attention.key_length", "u32", ghd), ("attention.value_length", "u32", ghd),
              ("attention.key_length_swa", "u32", t["head_dim"]),
              ("attention.value_length_swa", "u32", t["head_dim"]),
              ("attention.sliding_window", "u32", t["sliding_window"]),
              ("attention.sliding_window_pattern", "arr_bool", swa),
              ("attention.shared_kv_layers", "u32", 0),
              ("embedding_length_per_layer_input", "u32", 0),
              ("rope.freq_base", "f32", rp["full_attention"]["rope_theta"]),
              ("rope.freq_base_swa", "f32", rp["sliding_attention"]["rope_theta"]),
              ("rope.dimension_count", "u32", ghd),
              ("rope.dimension_count_swa", "u32", t["head_dim"]),
              ("final_logit_softcapping", "f32", t["final_logit_softcapping"]),
              ("expert_count", "u32", t["num_experts"]),
              ("expert_used_count", "u32", t["top_k_experts"]),
              ("expert_feed_forward_length", "u32", t["moe_intermediate_size"])]
        return "gemma4", kv, tensors
    # qwen35moe (src/models/qwen35moe.cpp). The real converter reorders V heads; with random
    # weights only the shapes matter.
    add("token_embd.weight", P + "embed_tokens")
    add("output.weight", "language_model.lm_head")
    add("output_norm.weight", P + "norm.weight")
    kh, vh = t["linear_num_key_heads"], t["linear_num_value_heads"]
    kd, vd = t["linear_key_head_dim"], t["linear_value_head_dim"]
    for L, lt in enumerate(t["layer_types"]):
        p, b = f"{P}layers.{L}.", f"blk.{L}."
        add(b + "attn_norm.weight", p + "input_layernorm.weight")
        add(b + "post_attention_norm.weight", p + "post_attention_layernorm.weight")
        if lt == "linear_attention":
            a = p + "linear_attn."
            add(b + "attn_qkv.weight", a + "in_proj_qkv")
            add(b + "attn_gate.weight", a + "in_proj_z")
            add(b + "ssm_beta.weight", a + "in_proj_b")
            add(b + "ssm_alpha.weight", a + "in_proj_a")
            add(b + "ssm_out.weight", a + "out_proj")
            conv = 2 * kh * kd + vh * vd
            add(b + "ssm_conv1d.weight", a + "conv1d.weight", shape=(conv, t["linear_conv_kernel_dim"]))
            add(b + "ssm_dt.bias", a + "dt_bias")
            # ssm_a = -exp(A_log), as the converter writes it
            tensors.append((b + "ssm_a", None, "F32", (vh,), dict(neg_exp_log_uniform=(0.5, 8.0))))
            add(b + "ssm_norm.weight", a + "norm.weight")
        else:
            a = p + "self_attn."
            add(b + "attn_q.weight", a + "q_proj")
            add(b + "attn_k.weight", a + "k_proj")
            add(b + "attn_v.weight", a + "v_proj")
            add(b + "attn_output.weight", a + "o_proj")
            add(b + "attn_q_norm.weight", a + "q_norm.weight")
            add(b + "attn_k_norm.weight", a + "k_norm.weight")
        m = p + "mlp."
        add(b + "ffn_gate_inp.weight", m + "gate")
        # [1, H] in MLX; llama.cpp wants a vector [H]
        add(b + "ffn_gate_inp_shexp.weight", m + "shared_expert_gate", kind="q8",
            shape=(t["hidden_size"],))
        for g, n in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
            add(f"{b}ffn_{g}_exps.weight", f"{m}switch_mlp.{n}")
            add(f"{b}ffn_{g}_shexp.weight", f"{m}shared_expert.{n}")
    rp = t["rope_parameters"]
    kv = [("context_length", "u32", t["max_position_embeddings"]),
          ("embedding_length", "u32", t["hidden_size"]),
          ("block_count", "u32", t["num_hidden_layers"]),
          ("feed_forward_length", "u32", t["shared_expert_intermediate_size"]),
          ("attention.head_count", "u32", t["num_attention_heads"]),
          ("attention.head_count_kv", "u32", t["num_key_value_heads"]),
          ("attention.key_length", "u32", t["head_dim"]),
          ("attention.value_length", "u32", t["head_dim"]),
          ("attention.layer_norm_rms_epsilon", "f32", t["rms_norm_eps"]),
          ("rope.freq_base", "f32", rp["rope_theta"]),
          ("rope.dimension_count", "u32", int(t["head_dim"] * rp["partial_rotary_factor"])),
          ("rope.dimension_sections", "arr_i32", list(rp["mrope_section"]) + [0]),
          ("expert_count", "u32", t["num_experts"]),
          ("expert_used_count", "u32", t["num_experts_per_tok"]),
          ("expert_feed_forward_length", "u32", t["moe_intermediate_size"]),
          ("expert_shared_feed_forward_length", "u32", t["shared_expert_intermediate_size"]),
          ("ssm.conv_kernel", "u32", t["linear_conv_kernel_dim"]),
          ("ssm.state_size", "u32", kd),
          ("ssm.group_count", "u32", kh),
          ("ssm.time_step_rank", "u32", vh),
          ("ssm.inner_size", "u32", vh * vd),
          ("full_attention_interval", "u32", t.get("full_attention_interval", 4))]
    return "qwen35moe", kv, tensors


def gguf_nbytes(kind: str, shape) -> int:
    n = int(np.prod(shape))
    return {"q4": n // 32 * Q4_0_BLOCK, "q8": n // 32 * Q8_0_BLOCK, "F32": n * 4}[kind]


def gguf_chunks(kind, shape, init, seed, name):
    rng = np.random.default_rng(seed_of(seed, name))
    if kind == "F32":
        if "values" in init:
            v = np.array(init["values"], dtype=np.float32)
        elif "neg_exp_log_uniform" in init:
            v = -rng.uniform(*init["neg_exp_log_uniform"], size=int(np.prod(shape))).astype(np.float32)
        else:
            v = small_values(shape, init, rng)
        yield v.tobytes()
        return
    cols = shape[-1]
    nrows = int(np.prod(shape[:-1]))
    sigma = init.get("sigma", 1.0 / np.sqrt(cols))
    bits = 4 if kind == "q4" else 8
    noise = Noise(rng)
    for _, n in chunk_rows(nrows, cols * bits // 8):
        yield ggml_rows(n, cols, bits, sigma, noise).tobytes()


def write_gguf(cfg: dict, out: Path, seed: int) -> None:
    try:
        import gguf  # noqa: PLC0415 (only this subcommand needs it)
    except ModuleNotFoundError:
        sys.exit("synth.py gguf needs the `gguf` package: `pip install gguf`, or put llama.cpp's "
                 "gguf-py on PYTHONPATH (PYTHONPATH=<llama.cpp>/gguf-py)")

    arch, kvs, tensors = gguf_plan(cfg)
    total = sum(gguf_nbytes(k, s) for _, _, k, s, _ in tensors)
    check_disk(out.parent, total)
    tmp = out.with_name(out.name + ".partial")
    w = gguf.GGUFWriter(str(tmp), arch)
    w.add_name(f"mference synthetic {arch}")
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0)
    for key, typ, val in kvs:
        k = f"{arch}.{key}"
        if typ == "u32":
            w.add_uint32(k, int(val))
        elif typ == "f32":
            w.add_float32(k, float(val))
        elif typ == "arr_i32":
            w.add_array(k, [int(x) for x in val])
        elif typ == "arr_bool":
            w.add_array(k, [bool(x) for x in val])
    add_vocab(w, cfg)
    qt = {"q4": gguf.GGMLQuantizationType.Q4_0, "q8": gguf.GGMLQuantizationType.Q8_0}
    for gname, _, kind, shape, _ in tensors:
        nb = gguf_nbytes(kind, shape)
        if kind == "F32":
            w.add_tensor_info(gname, shape, np.dtype(np.float32), nb)
        else:
            bshape = list(shape[:-1]) + [shape[-1] // 32 * (Q4_0_BLOCK if kind == "q4" else Q8_0_BLOCK)]
            w.add_tensor_info(gname, bshape, np.dtype(np.uint8), nb, raw_dtype=qt[kind])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    f = w.fout[0]
    align = w.data_alignment
    f.write(b"\0" * (-f.tell() % align))
    t0, done = time.time(), 0
    for gname, _, kind, shape, init in tensors:
        n = 0
        for chunk in gguf_chunks(kind, shape, init, seed, gname):
            f.write(chunk)
            n += len(chunk)
        assert n == gguf_nbytes(kind, shape), gname
        f.write(b"\0" * (-n % align))
        done += n
        progress(done, total, t0)
    w.close()
    os.replace(tmp, out)
    print(f"\nwrote {out}: {arch}, {len(tensors)} tensors, {out.stat().st_size:,} bytes, "
          f"{time.time() - t0:.0f} s", file=sys.stderr)


def add_vocab(w, cfg: dict) -> None:
    """The family's real tokenizer (assets/tokenizers) as GGUF BPE vocab: tokens by id, types,
    merges, special ids. Ids above the tokenizer's own vocabulary are padded as unused tokens."""
    import gguf  # noqa: PLC0415

    fam = family(cfg)
    t = cfg["text_config"]
    tj = json.loads((REPO / "assets/tokenizers" / ("gemma4" if fam == "gemma4" else "qwen3_6")
                     / "tokenizer.json").read_text())
    V = t["vocab_size"]
    toks = [None] * V
    types = [gguf.TokenType.NORMAL] * V
    for s, i in tj["model"]["vocab"].items():
        if i < V:
            toks[i] = s
    for a in tj.get("added_tokens", []):
        if a["id"] < V:
            toks[a["id"]] = a["content"]
            types[a["id"]] = gguf.TokenType.CONTROL if a.get("special") else gguf.TokenType.USER_DEFINED
    for i in range(V):
        if toks[i] is None:
            toks[i] = f"[PAD{i}]"
            types[i] = gguf.TokenType.UNUSED
    merges = tj["model"].get("merges", [])
    merges = [m if isinstance(m, str) else " ".join(m) for m in merges]
    if fam == "gemma4":
        w.add_tokenizer_model("gemma4")
        w.add_token_scores([0.0] * V)
        w.add_bos_token_id(2)
        w.add_eos_token_id(1)
        w.add_pad_token_id(0)
        w.add_unk_token_id(3)
        w.add_add_bos_token(True)
        w.add_add_space_prefix(False)
    else:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("qwen35")
        w.add_eos_token_id(248046)
        w.add_pad_token_id(248044)
        w.add_add_bos_token(False)
    w.add_token_list(toks)
    w.add_token_types(types)
    w.add_token_merges(merges)


# ------------------------------------------------------------------------------------------------


def check_disk(where: Path, need: int) -> None:
    free = shutil.disk_usage(where).free
    keep = int(os.environ.get("SYNTH_KEEP_FREE_GB", "10")) << 30
    if free - need < keep:
        raise SystemExit(f"not enough disk: {need / 1e9:.1f} GB to write, {free / 1e9:.1f} GB free, "
                         f"and {keep >> 30} GiB must stay free for others (SYNTH_KEEP_FREE_GB)")


def progress(done: int, total: int, t0: float) -> None:
    if sys.stderr.isatty() or done == total or (done // (1 << 30)) != ((done - 1) // (1 << 30)):
        el = time.time() - t0
        print(f"\r{done / 1e9:7.2f} / {total / 1e9:.2f} GB  {done / max(el, 1e-9) / 1e6:6.0f} MB/s",
              end="" if sys.stderr.isatty() else "\n", file=sys.stderr, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("format", choices=["mlx", "gguf", "plan"], help="plan: print the tensor list")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", choices=sorted(PRESETS))
    src.add_argument("--config", type=Path, help="an MLX config.json to take the shapes from")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--seed", type=int, default=20260721)
    ap.add_argument("--no-tokenizer", action="store_true")
    ap.add_argument("--inkling-layers", metavar="SPEC",
                    help="Inkling only: keep one layer per letter (d dense, s MoE sliding, g MoE "
                         "global; d's first), e.g. dsg: a full-width, layer-truncated model")
    a = ap.parse_args()
    cfg = PRESETS[a.model]() if a.model else json.loads(a.config.read_text())
    if a.inkling_layers:
        cfg = inkling_layers(cfg, a.inkling_layers)
    if a.format == "plan":
        for name, dt, shape, nbytes, _ in mlx_tensors(plan_of(cfg), cfg):
            print(name, dt, shape, nbytes)
        return
    if a.out is None:
        raise SystemExit("--out is required")
    if a.format == "mlx":
        write_mlx(cfg, a.out, a.seed, not a.no_tokenizer)
    else:
        write_gguf(cfg, a.out, a.seed)


if __name__ == "__main__":
    main()
