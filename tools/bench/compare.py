#!/usr/bin/env python3
"""Side by side: `mference bench` on a .gturbo install vs llama.cpp's llama-bench on the GGUF of the
same shapes (tools/synth/synth.py writes both), same threads, prompt lengths and decode length.

    .venv-bench/bin/python tools/bench/compare.py --ours work/g26.gturbo --gguf work/g26.gguf \
        --threads 2 --prompts 64,512 --gen 32 --repeats 3 --modes warm,capped --out work/cmp.json

Modes:
  warm    each engine's files are read into the page cache first (one engine at a time: both
          together may not fit in RAM), then measured. --rounds N does that N times, the engine
          order alternating round by round, and prints each round's ratios beside those of the
          medians over all rounds (a noisy machine's drift then falls on both engines).
  capped  each engine runs in a cgroup v1 memory cgroup limited to each of --cap-gib (default 8
          GiB; a list such as 8,4 runs every cap). The page cache the process faults in is charged
          to the cgroup, so the cap covers it. Every repeat is its own invocation: the engine's
          files are evicted from the page cache first (posix_fadvise DONTNEED), so each run starts
          cold, and the engines alternate repeat by repeat. The cgroup is created here (root) and
          removed afterwards.

--routing-trace FILE makes mference replay recorded expert choices (`mference bench
--routing-trace`). The engine `llama` runs llama.cpp on its own random routers; `llama-trace` runs
the same binary replaying the same trace (tools/bench/llama-routing-trace.patch, applied by
build_llama.sh: each MoE layer takes the trace's ids row by row, the router's own weights of
them), the like-for-like comparison. The engine `ours-router` runs mference without the trace.
Peak RSS: mference reports its own sampled peaks of RssAnon / RssFile in the bench JSON; for every
engine this script also samples the sum over the processes of the cgroup (capped) every 50 ms.

Floor (capped, with --odirect-GBps and --warm-ms): decode time per token against
bytes read per token / O_DIRECT bandwidth + warm time per token (prompt -> ms, from a warm
resident run of mference), both terms printed.

Both engines see pseudo-random token ids (llama-bench generates its own; mference bench uses
`--decode forced`, one pseudo-random id per decode step, as llama-bench's tg test does).
Decode in llama-bench is measured at depth = the prompt length (`-d`), like ours (decode follows the
prompt). Prints ours / llama.cpp ratios for prefill and decode, and the bandwidth floor:
bytes touched per decode token / measured memory copy bandwidth.
"""

import argparse
import contextlib
import fcntl
import json
import os
import statistics
import subprocess
import sys
import threading
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
    """Drops `paths` from the page cache (those that exist: the other engine's file may be gone)."""
    for p in paths:
        if not os.path.exists(p):
            continue
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


LOCK = None  # --lock: a file every timed step holds an exclusive flock on


@contextlib.contextmanager
def timed():
    """Holds --lock (if given) for one timed step, so timed runs of other scripts never overlap."""
    if LOCK is None:
        yield
        return
    with open(LOCK, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def status_split(pid: str) -> tuple:
    """(RssAnon, RssFile) of one process in bytes; (0, 0) once it is gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0, 0
    f = {l.split(":")[0]: l.split()[1] for l in text.splitlines() if l.startswith("Rss")}
    return int(f.get("RssAnon", 0)) * 1024, int(f.get("RssFile", 0)) * 1024


class CgroupRss(threading.Thread):
    """Samples the summed RssAnon / RssFile of the cgroup's processes every 50 ms; keeps each
    peak (not necessarily from the same moment)."""

    def __init__(self):
        super().__init__(daemon=True)
        self.stop, self.anon, self.file, self.samples = threading.Event(), 0, 0, 0

    def run(self):
        while not self.stop.wait(0.05):
            try:
                pids = (CGROUP / "cgroup.procs").read_text().split()
            except OSError:
                continue
            split = [status_split(p) for p in pids]
            self.anon = max(self.anon, sum(a for a, _ in split))
            self.file = max(self.file, sum(f for _, f in split))
            self.samples += 1


def run(cmd: list, capped: bool, timeout: float, env: dict = None) -> tuple:
    """Runs cmd (optionally inside the cgroup; `env`: extra environment variables); returns
    (stdout, seconds, max RSS KiB from /usr/bin/time, stderr, sampled peaks {anon, file} bytes or
    None)."""
    wrapped = ["/usr/bin/time", "-f", "MAXRSS_KIB %M"] + cmd
    sampler = None
    if capped:
        (CGROUP / "memory.max_usage_in_bytes").write_text("0")
        (CGROUP / "memory.failcnt").write_text("0")
        wrapped = ["sh", "-c", f'echo $$ > {CGROUP}/cgroup.procs && exec "$@"', "sh"] + wrapped
        sampler = CgroupRss()
        sampler.start()
    t0 = time.time()
    try:
        p = subprocess.run(wrapped, capture_output=True, text=True, timeout=timeout,
                           env={**os.environ, **(env or {})})
    finally:
        if sampler:
            sampler.stop.set()
            sampler.join()
    dt = time.time() - t0
    rss = 0
    for line in p.stderr.splitlines():
        if line.startswith("MAXRSS_KIB"):
            rss = int(line.split()[1])
    if p.returncode != 0:
        sys.stderr.write(p.stderr[-4000:])
        raise SystemExit(f"{cmd[0]} failed ({p.returncode})")
    peaks = ({"anon_bytes": sampler.anon, "file_bytes": sampler.file, "samples": sampler.samples}
             if sampler else None)
    return p.stdout, dt, rss, p.stderr, peaks


def ours(a, prompts: list, capped: bool, repeats: int, trace: bool = True) -> dict:
    cmd = [str(a.mference), "bench", "--model", str(a.ours), "--threads", str(a.threads),
           "--slots", a.slots, "--prompts", ",".join(map(str, prompts)), "--gen", str(a.gen),
           "--repeats", str(repeats), "--warmup", str(0 if capped else 1), "--decode", "forced",
           "--max-context", str(a.max_context)]
    if a.direct_io:
        cmd.append("--direct-io")
    if a.routing_trace and trace:
        cmd += ["--routing-trace", str(a.routing_trace)]
    cmd += ["--kernels", a.kernels]
    out, dt, rss, err, peaks = run(cmd, capped, a.timeout)
    doc = json.loads(out.strip().splitlines()[-1])
    # What `--slots auto` chose, as each child printed it.
    chose = sorted({l.strip() for l in err.splitlines() if l.startswith("[expert cache auto")})
    res = {"cmd": " ".join(cmd), "wall_s": dt, "max_rss_kib_time": rss, "summary": doc["summary"],
           "runs": doc["runs"], "settings": doc["settings"], "auto_sizing": chose,
           "cgroup_rss_peaks": peaks}
    if capped:
        res["cgroup"] = cgroup_stats()
    return res


def llama(a, prompts: list, capped: bool, repeats: int, evict_first=None,
          trace: bool = False) -> dict:
    """llama-bench prefill (-p N -n 0, skipped with --llama-no-pp) and decode at depth N
    (-p 0 -n G -d N), `repeats` each; `evict_first` (capped) is called before each invocation, so
    both start cold. `trace`: llama.cpp replays --routing-trace (our patch, build_llama.sh; a
    build without it refuses to say so, below). Keys are suffixed _pp / _tg."""
    env = {"MFERENCE_ROUTING_TRACE": str(a.routing_trace)} if trace else None
    extra = a.llama_args.split() if a.llama_args else []
    base = [str(a.llama_bench), "-m", str(a.gguf), "-t", str(a.threads)]
    tail = ["-r", str(repeats), "-o", "json"] + extra
    n = ",".join(map(str, prompts))
    res = {"pp": []}
    steps = [("tg", ["-p", "0", "-n", str(a.gen), "-d", n])]
    if not a.llama_no_pp:
        steps.insert(0, ("pp", ["-p", n, "-n", "0"]))
    for kind, args in steps:
        cmd = base + args + tail
        if evict_first:
            evict_first()
        out, dt, rss, err, peaks = run(cmd, capped, a.timeout, env)
        if trace and "routing trace:" not in err:
            raise SystemExit(f"{a.llama_bench} did not replay the trace: build it with "
                             "tools/bench/build_llama.sh (llama-routing-trace.patch)")
        res.update({kind: json.loads(out), f"{kind}_cmd": " ".join(cmd), f"wall_{kind}_s": dt,
                    f"max_rss_kib_time_{kind}": rss, f"cgroup_rss_peaks_{kind}": peaks})
        if capped:
            res[f"cgroup_{kind}"] = cgroup_stats()
    return res


def merge_ours(parts: list) -> dict:
    """One `ours` result from several single-repeat invocations: every run, medians per prompt."""
    runs = [r for p in parts for r in p["runs"]]
    summary = []
    for s in parts[0]["summary"]:
        mine = [r for r in runs if r["prompt"] == s["prompt"]]
        med = lambda k: statistics.median(r[k] for r in mine)
        row = {k: med(k) for k in ("prefill_tok_s", "decode_tok_s", "hit_rate", "bytes_per_token",
                                   "read_wait_per_token_s", "compute_per_token_s",
                                   "peak_rss_bytes", "peak_rss_anon_bytes",
                                   "peak_rss_file_bytes")}
        row.update(prompt=s["prompt"], prompt_tokens=s["prompt_tokens"], runs=len(mine),
                   decode_tok_s_range=[min(r["decode_tok_s"] for r in mine),
                                       max(r["decode_tok_s"] for r in mine)],
                   prefill_tok_s_range=[min(r["prefill_tok_s"] for r in mine),
                                        max(r["prefill_tok_s"] for r in mine)],
                   finite=all(r["finite"] for r in mine))
        summary.append(row)
    return {"parts": parts, "runs": runs, "summary": summary, "settings": parts[0]["settings"],
            "auto_sizing": sorted({c for p in parts for c in p["auto_sizing"]}),
            "wall_s": sum(p["wall_s"] for p in parts)}


def merge_llama(parts: list) -> dict:
    """llama-bench JSON rows of several single-repeat invocations, averaged like its own -r
    (avg_ts over the samples), plus the median and range of the per-invocation values."""
    def merged(key):
        rows = {}
        for p in parts:
            for t in p[key]:
                rows.setdefault((t["n_prompt"], t["n_gen"], t.get("n_depth", 0)), []).append(t)
        out = []
        for ts in rows.values():
            vals = [t["avg_ts"] for t in ts]
            out.append(dict(ts[0], avg_ts=statistics.median(vals), samples_ts=vals,
                            range_ts=[min(vals), max(vals)]))
        return out
    return {"parts": parts, "pp": merged("pp"), "tg": merged("tg")}


def ratios(o: dict, l: dict) -> list:
    rows = []
    for s in o["summary"]:
        n = s["prompt_tokens"]
        pp = [t for t in l["pp"] if t["n_prompt"] == n and t["n_gen"] == 0]
        tg = [t for t in l["tg"] if t["n_gen"] > 0 and t.get("n_depth", 0) == n]
        lp = pp[0]["avg_ts"] if pp else None
        lg = tg[0]["avg_ts"] if tg else None
        rows.append({"prompt_tokens": n,
                     "llama_decode_range": tg[0].get("range_ts") if tg else None,
                     "ours_decode_range": s.get("decode_tok_s_range"),
                     "ours_prefill_tok_s": s["prefill_tok_s"], "llama_prefill_tok_s": lp,
                     "prefill_ratio": s["prefill_tok_s"] / lp if lp else None,
                     "ours_decode_tok_s": s["decode_tok_s"], "llama_decode_tok_s": lg,
                     "decode_ratio": s["decode_tok_s"] / lg if lg else None,
                     "ours_hit_rate": s["hit_rate"],
                     "ours_expert_MiB_per_token": s["bytes_per_token"] / 2**20,
                     "ours_read_wait_ms_per_token": s["read_wait_per_token_s"] * 1e3,
                     "ours_compute_ms_per_token": s["compute_per_token_s"] * 1e3,
                     "ours_peak_rss_MiB": s["peak_rss_bytes"] / 2**20,
                     "ours_peak_anon_MiB": s.get("peak_rss_anon_bytes", 0) / 2**20,
                     "ours_peak_file_MiB": s.get("peak_rss_file_bytes", 0) / 2**20})
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
    ap.add_argument("--rounds", type=int, default=1,
                    help="warm mode: measure each engine this many times, alternating which goes "
                         "first; the ratios of each round and of the medians over all are printed")
    ap.add_argument("--slots", default="16")
    ap.add_argument("--max-context", type=int, default=4096)
    ap.add_argument("--direct-io", action="store_true")
    ap.add_argument("--kernels", default="auto",
                    help="mference kernel table: auto (exact), avx512i16 (int16 activations) or avx512vnni (int8 prefill)")
    ap.add_argument("--modes", default="warm,capped")
    ap.add_argument("--engines", default="ours,llama",
                    help="of ours, ours-router (mference on its own routers), llama, llama-trace "
                         "(llama.cpp replaying --routing-trace: needs the patched build)")
    ap.add_argument("--cap-gib", default="8", help="one cap or a list (8,4), GiB")
    ap.add_argument("--routing-trace", type=Path,
                    help="mference replays this routing (.npy); llama.cpp keeps its own routers")
    ap.add_argument("--llama-no-pp", action="store_true",
                    help="skip llama-bench's prefill run (decode only)")
    ap.add_argument("--odirect-GBps", type=float,
                    help="measured O_DIRECT read bandwidth of the disk, GB/s (floor)")
    ap.add_argument("--warm-ms", default="",
                    help="warm decode ms per token per prompt, e.g. 64:80.1,512:95.3 (floor)")
    ap.add_argument("--llama-args", default="",
                    help="extra llama-bench flags, e.g. '--repack 0' (its default repacks Q4_0 into "
                         "an anonymous copy of every weight, which cannot fit under an 8 GiB cap)")
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--lock", type=Path,
                    help="hold an exclusive flock on this file during each timed step")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    global LOCK
    LOCK = a.lock
    prompts = [int(x) for x in a.prompts.split(",")]
    engines = a.engines.split(",")
    result = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "argv": sys.argv[1:],
              "uname": os.uname().release, "cpu": cpu_model(), "nproc": os.cpu_count(),
              "bandwidth": bandwidth(), "bytes": bytes_per_token(a.ours)}
    bw = result["bandwidth"]["read_GBps"] * 1e9
    result["floor_tok_s"] = bw / result["bytes"]["bytes_per_token"]
    warm_ms = {int(k): float(v) for k, v in (x.split(":") for x in a.warm_ms.split(",") if x)}
    for mode in a.modes.split(","):
        caps = [float(c) for c in a.cap_gib.split(",")] if mode == "capped" else [None]
        for cap in caps:
            key = mode if cap is None else f"capped-{cap:g}GiB"
            res = capped_mode(a, prompts, engines, cap) if cap else warm_mode(a, prompts, engines)
            # "ratios": against llama.cpp on its own routers; "ratios_trace": against llama.cpp
            # replaying the same trace as mference (engine llama-trace).
            for peer, rkey in (("llama", "ratios"), ("llama-trace", "ratios_trace")):
                if "ours" in res and peer in res:
                    res[rkey] = ratios(res["ours"], res[peer])
                    if cap and a.odirect_GBps:
                        floor(res[rkey], a.odirect_GBps, warm_ms)
            result[key] = res
            a.out.write_text(json.dumps(result, indent=1) + "\n")
            print_mode(key, res)
    print(f"bandwidth: copy {result['bandwidth']['copy_GBps']:.1f} GB/s, read "
          f"{result['bandwidth']['read_GBps']:.1f} GB/s (1 thread); bytes/token "
          f"{result['bytes']['bytes_per_token'] / 1e9:.3f} GB -> floor {result['floor_tok_s']:.2f} tok/s")


def warm_mode(a, prompts: list, engines: list) -> dict:
    """Each engine's files read into the page cache, its runs, the files evicted (both engines'
    files together may not fit in RAM). With --rounds N that N times, the engine order alternating
    round by round, so that a machine's drift over minutes falls on both engines; each round's
    ratios are kept (res["rounds"]) beside those of the medians over every round's runs."""
    res = {"loadavg_before": os.getloadavg()}
    parts = {e: [] for e in engines}
    for i in range(a.rounds):
        for eng in engines if i % 2 == 0 else engines[::-1]:
            files = files_of(a.ours) if eng.startswith("ours") else [a.gguf]
            with timed():
                res.setdefault(f"{eng}_warm_read_s", []).append(warm(files))
                print(f"[compare] warm: {eng} round {i + 1}/{a.rounds} ...", file=sys.stderr,
                      flush=True)
                load0 = os.getloadavg()
                r = (llama(a, prompts, False, a.repeats, trace=eng == "llama-trace")
                     if eng.startswith("llama")
                     else ours(a, prompts, False, a.repeats, trace=eng == "ours"))
                r["loadavg_before"], r["loadavg_after"] = load0, os.getloadavg()
            parts[eng].append(r)
            evict(files)  # leave room in RAM for the other engine's warm run
    for eng, p in parts.items():
        res[eng] = p[0] if len(p) == 1 else (merge_llama(p) if eng.startswith("llama")
                                             else merge_ours(p))
    if a.rounds == 1:  # the one-round document as before: one warm read per engine
        for eng in engines:
            res[f"{eng}_warm_read_s"] = res[f"{eng}_warm_read_s"][0]
    if a.rounds > 1 and "ours" in parts:
        res["rounds"] = [{peer: ratios(parts["ours"][i], parts[peer][i])
                          for peer in ("llama", "llama-trace") if peer in parts}
                         for i in range(a.rounds)]
    res["loadavg_after"] = os.getloadavg()
    return res


def capped_mode(a, prompts: list, engines: list, cap_gib: float) -> dict:
    """Each repeat one invocation per engine, files evicted before each; the engine order
    alternates repeat by repeat."""
    res = {"cap_gib": cap_gib, "loadavg_before": os.getloadavg()}
    parts = {e: [] for e in engines}
    cgroup_create(int(cap_gib * 2**30))
    try:
        for i in range(a.repeats):
            for eng in engines if i % 2 == 0 else engines[::-1]:
                # Both engines' files: what the other engine left cached stays charged to the
                # cgroup otherwise (and is not a cold start).
                files = files_of(a.ours) + [a.gguf]
                print(f"[compare] capped {cap_gib:g} GiB: {eng} repeat {i + 1}/{a.repeats} ...",
                      file=sys.stderr, flush=True)
                with timed():
                    load0 = os.getloadavg()
                    if eng.startswith("llama"):
                        r = llama(a, prompts, True, 1, evict_first=lambda: evict(files),
                                  trace=eng == "llama-trace")
                    else:
                        evict(files)
                        r = ours(a, prompts, True, 1, trace=eng == "ours")
                    r["loadavg_before"], r["loadavg_after"] = load0, os.getloadavg()
                parts[eng].append(r)
                a.out.with_suffix(".partial.json").write_text(json.dumps(parts, indent=1) + "\n")
    finally:
        cgroup_remove()
    for eng, p in parts.items():
        res[eng] = merge_llama(p) if eng.startswith("llama") else merge_ours(p)
    res["loadavg_after"] = os.getloadavg()
    return res


def floor(rows: list, odirect_gbps: float, warm_ms: dict) -> None:
    """Adds the floor: expert bytes read per decode token / O_DIRECT bandwidth + warm ms/token."""
    for r in rows:
        io_ms = r["ours_expert_MiB_per_token"] * 2**20 / (odirect_gbps * 1e9) * 1e3
        w = warm_ms.get(r["prompt_tokens"])
        r["floor_io_ms"], r["floor_warm_ms"] = io_ms, w
        r["ours_decode_ms"] = 1e3 / r["ours_decode_tok_s"]
        if w is not None:
            r["floor_ms"] = io_ms + w
            r["decode_over_floor"] = r["ours_decode_ms"] / r["floor_ms"]


def print_mode(mode: str, res: dict) -> None:
    for peer, r in [(p, r) for p, k in (("llama", "ratios"), ("llama-trace", "ratios_trace"))
                    for r in res.get(k, [])]:
        print(f"{mode:7} vs {peer} prompt {r['prompt_tokens']:5}: prefill ours {r['ours_prefill_tok_s']:8.2f} "
              f"llama {r['llama_prefill_tok_s'] or 0:8.2f} ratio {r['prefill_ratio'] or 0:5.2f} | decode ours "
              f"{r['ours_decode_tok_s']:6.2f} llama {r['llama_decode_tok_s'] or 0:6.2f} ratio "
              f"{r['decode_ratio'] or 0:5.2f} | hit {r['ours_hit_rate'] * 100:4.1f}% wait "
              f"{r['ours_read_wait_ms_per_token']:.1f} ms/t RSS {r['ours_peak_rss_MiB']:.0f} MiB "
              f"(anon {r['ours_peak_anon_MiB']:.0f}, file {r['ours_peak_file_MiB']:.0f})")
        if "floor_ms" in r:
            print(f"{'':7} floor {r['floor_ms']:.1f} ms = io {r['floor_io_ms']:.1f} + warm "
                  f"{r['floor_warm_ms']:.1f}; ours {r['ours_decode_ms']:.1f} ms/token = "
                  f"{r['decode_over_floor']:.2f}x floor")
    for i, rnd in enumerate(res.get("rounds", [])):
        for peer, rows in rnd.items():
            print(f"{'':7} round {i + 1} vs {peer}: " + " | ".join(
                f"{r['prompt_tokens']}: prefill {r['prefill_ratio'] or 0:.2f} decode "
                f"{r['decode_ratio'] or 0:.2f}" for r in rows))
    for eng in ("ours", "ours-router"):
        if eng in res and res[eng].get("auto_sizing"):
            print(f"{'':7} {eng}: " + " | ".join(res[eng]["auto_sizing"]))


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "?"


if __name__ == "__main__":
    main()
