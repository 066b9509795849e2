#!/usr/bin/env python3
"""Side by side: `mference bench` on a .gturbo install vs llama.cpp's llama-bench on the GGUF of the
same shapes (tools/synth/synth.py writes both), same threads, prompt lengths and decode length.

    .venv-bench/bin/python tools/bench/compare.py --ours work/g26.gturbo --gguf work/g26.gguf \
        --threads 2 --prompts 64,512 --gen 32 --repeats 3 --modes warm,capped --out work/cmp.json

Modes:
  warm    each engine's files are read into the page cache first (one engine at a time: both
          together may not fit in RAM), then measured.
  capped  each engine runs in a cgroup v1 memory cgroup limited to --cap-gib (default 8 GiB). The
          page cache the process faults in is charged to the cgroup, so the cap covers it. The
          engine's files are evicted from the page cache first (posix_fadvise DONTNEED), so the run
          starts cold. The cgroup is created here (root) and removed afterwards.

Both engines see pseudo-random token ids (llama-bench generates its own; mference bench uses
`--decode forced`, one pseudo-random id per decode step, as llama-bench's tg test does).
Decode in llama-bench is measured at depth = the prompt length (`-d`), like ours (decode follows the
prompt). Prints ours / llama.cpp ratios for prefill and decode, and the bandwidth floor:
bytes touched per decode token / measured memory copy bandwidth.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
CGROUP = Path("/sys/fs/cgroup/memory/mference-bench")


def files_of(path: Path) -> list:
    if path.is_file():
        return [path]
    return sorted(p for p in path.rglob("*") if p.is_file())


def warm(paths: list) -> float:
    t0, buf = time.time(), bytearray(16 << 20)
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass
    return time.time() - t0


def evict(paths: list) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def cgroup_create(limit: int) -> None:
    if not Path("/sys/fs/cgroup/memory").is_dir():
        raise SystemExit("no cgroup v1 memory controller at /sys/fs/cgroup/memory")
    CGROUP.mkdir(exist_ok=True)
    (CGROUP / "memory.limit_in_bytes").write_text(str(limit))


def cgroup_remove() -> None:
    if CGROUP.exists():
        try:
            (CGROUP / "memory.force_empty").write_text("0")
        except OSError:
            pass
        CGROUP.rmdir()


def cgroup_stats() -> dict:
    def rd(n):
        return int((CGROUP / n).read_text())
    return {"max_usage_bytes": rd("memory.max_usage_in_bytes"), "failcnt": rd("memory.failcnt")}


def run(cmd: list, capped: bool, timeout: float) -> tuple:
    """Runs cmd (optionally inside the cgroup); returns (stdout, seconds, max RSS KiB from
    /usr/bin/time)."""
    wrapped = ["/usr/bin/time", "-f", "MAXRSS_KIB %M"] + cmd
    if capped:
        (CGROUP / "memory.max_usage_in_bytes").write_text("0")
        (CGROUP / "memory.failcnt").write_text("0")
        wrapped = ["sh", "-c", f'echo $$ > {CGROUP}/cgroup.procs && exec "$@"', "sh"] + wrapped
    t0 = time.time()
    p = subprocess.run(wrapped, capture_output=True, text=True, timeout=timeout)
    dt = time.time() - t0
    rss = 0
    for line in p.stderr.splitlines():
        if line.startswith("MAXRSS_KIB"):
            rss = int(line.split()[1])
    if p.returncode != 0:
        sys.stderr.write(p.stderr[-4000:])
        raise SystemExit(f"{cmd[0]} failed ({p.returncode})")
    return p.stdout, dt, rss


def ours(a, prompts: list, capped: bool) -> dict:
    cmd = [str(a.mference), "bench", "--model", str(a.ours), "--threads", str(a.threads),
           "--slots", a.slots, "--prompts", ",".join(map(str, prompts)), "--gen", str(a.gen),
           "--repeats", str(a.repeats), "--warmup", str(0 if capped else 1), "--decode", "forced",
           "--ctx", str(a.ctx)]
    if a.direct_io:
        cmd.append("--direct-io")
    cmd += ["--kernels", a.kernels]
    out, dt, rss = run(cmd, capped, a.timeout)
    doc = json.loads(out.strip().splitlines()[-1])
    res = {"cmd": " ".join(cmd), "wall_s": dt, "max_rss_kib_time": rss, "summary": doc["summary"],
           "runs": doc["runs"]}
    if capped:
        res["cgroup"] = cgroup_stats()
    return res


def llama(a, prompts: list, capped: bool) -> dict:
    extra = a.llama_args.split() if a.llama_args else []
    cmd = [str(a.llama_bench), "-m", str(a.gguf), "-t", str(a.threads),
           "-p", ",".join(map(str, prompts)), "-n", "0", "-r", str(a.repeats), "-o", "json"] + extra
    out, dt_p, rss_p = run(cmd, capped, a.timeout)
    pp = json.loads(out)
    res = {"pp_cmd": " ".join(cmd), "pp": pp, "max_rss_kib_time_pp": rss_p}
    if capped:
        res["cgroup_pp"] = cgroup_stats()
    cmd = [str(a.llama_bench), "-m", str(a.gguf), "-t", str(a.threads), "-p", "0",
           "-n", str(a.gen), "-d", ",".join(map(str, prompts)), "-r", str(a.repeats), "-o", "json"]
    cmd += extra
    out, dt_g, rss_g = run(cmd, capped, a.timeout)
    res.update(tg_cmd=" ".join(cmd), tg=json.loads(out), max_rss_kib_time_tg=rss_g,
               wall_s=dt_p + dt_g)
    if capped:
        res["cgroup_tg"] = cgroup_stats()
    return res


def ratios(o: dict, l: dict) -> list:
    rows = []
    for s in o["summary"]:
        n = s["prompt_tokens"]
        pp = [t for t in l["pp"] if t["n_prompt"] == n and t["n_gen"] == 0]
        tg = [t for t in l["tg"] if t["n_gen"] > 0 and t.get("n_depth", 0) == n]
        lp = pp[0]["avg_ts"] if pp else None
        lg = tg[0]["avg_ts"] if tg else None
        rows.append({"prompt_tokens": n,
                     "ours_prefill_tok_s": s["prefill_tok_s"], "llama_prefill_tok_s": lp,
                     "prefill_ratio": s["prefill_tok_s"] / lp if lp else None,
                     "ours_decode_tok_s": s["decode_tok_s"], "llama_decode_tok_s": lg,
                     "decode_ratio": s["decode_tok_s"] / lg if lg else None,
                     "ours_hit_rate": s["hit_rate"],
                     "ours_expert_MiB_per_token": s["bytes_per_token"] / 2**20,
                     "ours_read_wait_ms_per_token": s["read_wait_per_token_s"] * 1e3,
                     "ours_compute_ms_per_token": s["compute_per_token_s"] * 1e3,
                     "ours_peak_rss_MiB": s["peak_rss_bytes"] / 2**20})
    return rows


def bandwidth() -> dict:
    """Single-thread memory copy bandwidth (numpy copyto of 512 MiB; read + write bytes / s), best
    of 5, and read bandwidth (sum of a 512 MiB uint64 array)."""
    src = np.ones(64 << 20, dtype=np.uint64)
    dst = np.empty_like(src)
    best_c = best_r = 0.0
    for _ in range(5):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best_c = max(best_c, 2 * src.nbytes / (time.perf_counter() - t0))
        t0 = time.perf_counter()
        src.sum()
        best_r = max(best_r, src.nbytes / (time.perf_counter() - t0))
    return {"copy_GBps": best_c / 1e9, "read_GBps": best_r / 1e9}


def bytes_per_token(install: Path) -> dict:
    """Bytes a decode step touches: the whole resident file (attention, shared MLP, router, and the
    tied or untied head: the embedding is one row, but the head reads it all) + top_k / experts of
    the expert files."""
    cfg = json.loads((install / "tokenizer/config.json").read_text())
    t = cfg.get("text_config", cfg)
    e = t["num_experts"]
    k = t.get("top_k_experts") or t.get("num_experts_per_tok")
    resident = (install / "model_weights.bin").stat().st_size
    experts = sum(p.stat().st_size for p in (install / "packed_experts").glob("layer_*.bin"))
    return {"resident_bytes": resident, "expert_bytes": experts, "top_k": k, "experts": e,
            "bytes_per_token": resident + experts * k / e}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ours", type=Path, required=True, help=".gturbo install")
    ap.add_argument("--gguf", type=Path, required=True)
    ap.add_argument("--mference", type=Path, default=REPO / "target/release/mference")
    ap.add_argument("--llama-bench", type=Path, default=REPO / "work/llama/build/bin/llama-bench")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--prompts", default="64,512")
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--slots", default="16")
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--direct-io", action="store_true")
    ap.add_argument("--kernels", default="auto",
                    help="mference kernel table: auto (exact), or avx512vnni (int8 prefill)")
    ap.add_argument("--modes", default="warm,capped")
    ap.add_argument("--engines", default="ours,llama")
    ap.add_argument("--cap-gib", type=float, default=8.0)
    ap.add_argument("--llama-args", default="",
                    help="extra llama-bench flags, e.g. '--repack 0' (its default repacks Q4_0 into "
                         "an anonymous copy of every weight, which cannot fit under an 8 GiB cap)")
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    prompts = [int(x) for x in a.prompts.split(",")]
    engines = a.engines.split(",")
    result = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "argv": sys.argv[1:],
              "uname": os.uname().release, "cpu": cpu_model(), "nproc": os.cpu_count(),
              "bandwidth": bandwidth(), "bytes": bytes_per_token(a.ours)}
    bw = result["bandwidth"]["read_GBps"] * 1e9
    result["floor_tok_s"] = bw / result["bytes"]["bytes_per_token"]
    for mode in a.modes.split(","):
        capped = mode == "capped"
        res = {"loadavg_before": os.getloadavg()}
        if capped:
            cgroup_create(int(a.cap_gib * 2**30))
        try:
            for eng in engines:
                files = files_of(a.ours) if eng == "ours" else [a.gguf]
                if capped:
                    evict(files)
                else:
                    res[f"{eng}_warm_read_s"] = warm(files)
                print(f"[compare] {mode}: {eng} ...", file=sys.stderr, flush=True)
                load0 = os.getloadavg()
                res[eng] = ours(a, prompts, capped) if eng == "ours" else llama(a, prompts, capped)
                res[eng]["loadavg_before"], res[eng]["loadavg_after"] = load0, os.getloadavg()
                if not capped:
                    evict(files)  # leave room in RAM for the other engine's warm run
        finally:
            if capped:
                cgroup_remove()
        res["loadavg_after"] = os.getloadavg()
        if "ours" in res and "llama" in res:
            res["ratios"] = ratios(res["ours"], res["llama"])
        result[mode] = res
        a.out.write_text(json.dumps(result, indent=1) + "\n")
        print_mode(mode, res)
    print(f"bandwidth: copy {result['bandwidth']['copy_GBps']:.1f} GB/s, read "
          f"{result['bandwidth']['read_GBps']:.1f} GB/s (1 thread); bytes/token "
          f"{result['bytes']['bytes_per_token'] / 1e9:.3f} GB -> floor {result['floor_tok_s']:.2f} tok/s")


def print_mode(mode: str, res: dict) -> None:
    for r in res.get("ratios", []):
        print(f"{mode:7} prompt {r['prompt_tokens']:5}: prefill ours {r['ours_prefill_tok_s']:8.2f} "
              f"llama {r['llama_prefill_tok_s'] or 0:8.2f} ratio {r['prefill_ratio'] or 0:5.2f} | decode ours "
              f"{r['ours_decode_tok_s']:6.2f} llama {r['llama_decode_tok_s'] or 0:6.2f} ratio "
              f"{r['decode_ratio'] or 0:5.2f} | hit {r['ours_hit_rate'] * 100:4.1f}% wait "
              f"{r['ours_read_wait_ms_per_token']:.1f} ms/t RSS {r['ours_peak_rss_MiB']:.0f} MiB")


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "?"


if __name__ == "__main__":
    main()
