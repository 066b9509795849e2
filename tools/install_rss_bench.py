#!/usr/bin/env python3
"""Install benchmark: write a synthetic >= 2 GB Gemma-4-shaped MLX 4-bit checkpoint, install it
with the `gturbo-install` helper, report wall time and the installer's peak RSS (must stay
< 64 MiB: copies go through <= 512 KiB tiles, no tensor/expert/shard is held in memory). The
checkpoint has no tokenizer files: with them the installer also holds them and parses
`tokenizer.json` before the copy (measured 512 MB peak RSS with Gemma 4's 262,144-id tokenizer, from
25 MB without it).

usage: tools/install_rss_bench.py [WORKDIR]   (needs `cargo build --release -p mference-install`)
"""
import json, os, resource, shutil, struct, subprocess, sys, time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
work = sys.argv[1] if len(sys.argv) > 1 else "/tmp/mference-install-bench"
shutil.rmtree(work, ignore_errors=True)
src = os.path.join(work, "src")
os.makedirs(src)

H, M, E, L, V, G = 1024, 1024, 64, 20, 262144, 64
cfg = json.load(open(os.path.join(ROOT, "assets/models/gemma4-tiny/config.json")))
tc = cfg["text_config"]
tc.update(hidden_size=H, moe_intermediate_size=M, num_experts=E, num_hidden_layers=L, vocab_size=V,
          layer_types=["sliding_attention"] * (L - 1) + ["full_attention"])
for k in [k for k in cfg["quantization"] if k.startswith("language_model.")]:
    del cfg["quantization"][k]
cfg["quantization_config"] = cfg["quantization"]
json.dump(cfg, open(os.path.join(src, "config.json"), "w"))

tensors = []  # (name, dtype, shape)
def q(name, lead, out, inp):
    tensors.append((name + ".weight", "U32", lead + [out, inp * 4 // 32]))
    tensors.append((name + ".scales", "BF16", lead + [out, inp // G]))
    tensors.append((name + ".biases", "BF16", lead + [out, inp // G]))
q("language_model.model.embed_tokens", [], V, H)
tensors.append(("language_model.model.norm.weight", "BF16", [H]))
for l in range(L):
    p = f"language_model.model.layers.{l}."
    tensors.append((p + "input_layernorm.weight", "BF16", [H]))
    q(p + "experts.switch_glu.gate_proj", [E], M, H)
    q(p + "experts.switch_glu.up_proj", [E], M, H)
    q(p + "experts.switch_glu.down_proj", [E], H, M)
header, off = {"__metadata__": {"format": "mlx"}}, 0
for name, dt, shape in tensors:
    n = (4 if dt == "U32" else 2)
    for d in shape:
        n *= d
    header[name] = {"dtype": dt, "shape": shape, "data_offsets": [off, off + n]}
    off += n
hb = json.dumps(header).encode()
hb += b" " * (-len(hb) % 8)
with open(os.path.join(src, "model.safetensors"), "wb") as f:
    f.write(struct.pack("<Q", len(hb)) + hb)
    chunk = os.urandom(8 << 20)
    left = off
    while left:
        k = min(left, len(chunk))
        f.write(chunk[:k])
        left -= k
json.dump({"metadata": {"total_size": off}, "weight_map": {t[0]: "model.safetensors" for t in tensors}},
          open(os.path.join(src, "model.safetensors.index.json"), "w"))
print(f"synthetic source: {off / 1e9:.2f} GB of tensor data, {len(tensors)} tensors")

exe = os.path.join(ROOT, "target/release/gturbo-install")
t0 = time.time()
subprocess.run([exe, "--dir", src, "--out", os.path.join(work, "out.gturbo"), "--quiet"], check=True)
dt = time.time() - t0
peak_mib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
print(f"installed in {dt:.1f} s ({off / dt / 1e6:.0f} MB/s incl. hashing); installer peak RSS {peak_mib:.1f} MiB")
print("PASS" if peak_mib < 64 else "FAIL: peak RSS >= 64 MiB")
shutil.rmtree(work, ignore_errors=True)
sys.exit(0 if peak_mib < 64 else 1)
