#!/usr/bin/env python3
"""O_DIRECT read bandwidth of the disk under an install, as mference's expert reads see it: fio
random reads of one expert stride at stride-aligned offsets, one job per I/O thread (the streamer's
pool has 4), each job over its own layer file, `--readonly`; plus `dd iflag=direct bs=4M` of one
layer file (sequential, one reader). Medians of --repeats runs; the page cache is not involved
(O_DIRECT), so nothing needs evicting.

    .venv-bench/bin/python tools/bench/disk_bw.py --install work/gemma4-26b.gturbo --out work/disk.json

Needs fio (Debian: apt-get install fio).
"""

import argparse
import json
import statistics
import subprocess
import time
from pathlib import Path


def fio(files: list, stride: int, seconds: int) -> dict:
    cmd = ["fio", "--output-format=json", "--readonly", "--direct=1", "--rw=randread",
           f"--bs={stride}", "--ioengine=psync", "--time_based", f"--runtime={seconds}",
           "--group_reporting"]
    for i, f in enumerate(files):
        cmd += [f"--name=io{i}", f"--filename={f}"]
    doc = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
    r = doc["jobs"][0]["read"]
    return {"GBps": r["bw_bytes"] / 1e9, "iops": r["iops"],
            "lat_ms_median": r["clat_ns"]["percentile"].get("50.000000", 0) / 1e6}


def dd(path: Path) -> float:
    t0 = time.perf_counter()
    subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=4M", "iflag=direct"],
                   capture_output=True, check=True)
    return path.stat().st_size / (time.perf_counter() - t0) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--install", type=Path, required=True, help=".gturbo install")
    ap.add_argument("--jobs", type=int, default=4, help="concurrent readers (mference: 4)")
    ap.add_argument("--seconds", type=int, default=10, help="per fio run")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    man = json.loads((a.install / "manifest.json").read_text())
    stride = man["expertStride"]
    files = sorted((a.install / "packed_experts").glob("layer_*.bin"))[: a.jobs]
    runs = {"fio": [], "fio_1job": [], "dd": []}
    for _ in range(a.repeats):
        runs["fio"].append(fio(files, stride, a.seconds))
        runs["fio_1job"].append(fio(files[:1], stride, a.seconds))
        runs["dd"].append(dd(files[-1]))
    med = lambda xs: statistics.median(xs)
    doc = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "install": str(a.install),
           "stride": stride, "jobs": len(files), "runs": runs,
           "fio_GBps_median": med([r["GBps"] for r in runs["fio"]]),
           "fio_GBps_range": [min(r["GBps"] for r in runs["fio"]),
                              max(r["GBps"] for r in runs["fio"])],
           "fio_1job_GBps_median": med([r["GBps"] for r in runs["fio_1job"]]),
           "dd_GBps_median": med(runs["dd"]), "dd_GBps_range": [min(runs["dd"]), max(runs["dd"])]}
    a.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"O_DIRECT {stride}-byte random reads, {len(files)} jobs: "
          f"{doc['fio_GBps_median']:.2f} GB/s (range {doc['fio_GBps_range'][0]:.2f}-"
          f"{doc['fio_GBps_range'][1]:.2f}); 1 job {doc['fio_1job_GBps_median']:.2f}; "
          f"dd bs=4M sequential {doc['dd_GBps_median']:.2f} GB/s")


if __name__ == "__main__":
    main()
