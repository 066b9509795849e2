#!/usr/bin/env python3
"""Time to the first token of `mference run`, from process start (issue 32 item 5).

Runs `BIN run --model MODEL --prompt PROMPT --max-new 1 --temperature 0 --quiet` ROUNDS times per
binary (binaries alternate run by run, so drift in the host's load hits each alike) and reports,
per binary, the median and spread of
  - first byte: seconds from spawn until the first byte of the reply reaches stdout;
  - wall: seconds from spawn until the process has exited;
  - cpu: user + system CPU seconds of the process (all its threads): on a shared host, the part
    of the cost that other processes' load does not stretch.
A warm-up run per binary comes first and is not counted (page cache, and the tokenizer cache of an
install that has none yet).

    tools/bench/startup.py --model work/gemma4-tiny.gturbo [--rounds 15] BIN [BIN ...]
"""

import argparse
import os
import selectors
import statistics
import subprocess
import sys
import time

PROMPT = "It is a truth universally acknowledged, that"


def one(binary, model, prompt, extra):
    cmd = [binary, "run", "--model", model, "--prompt", prompt, "--max-new", "1",
           "--temperature", "0", "--quiet", *extra]
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    sel = selectors.DefaultSelector()
    sel.register(p.stdout, selectors.EVENT_READ)
    sel.register(p.stderr, selectors.EVENT_READ)
    first = None
    out, err = b"", b""
    while sel.get_map():
        for key, _ in sel.select():
            chunk = os.read(key.fileobj.fileno(), 65536)
            if not chunk:
                sel.unregister(key.fileobj)
            elif key.fileobj is p.stdout:
                if first is None and chunk.strip():
                    first = time.perf_counter() - t0
                out += chunk
            else:
                err += chunk
    _, status, ru = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t0
    rc = os.waitstatus_to_exitcode(status)
    p.returncode = rc
    cpu = ru.ru_utime + ru.ru_stime
    if rc != 0 or first is None:
        sys.exit(f"{' '.join(cmd)} failed (exit {rc}, stdout {out!r}):\n{err.decode(errors='replace')}")
    return first, wall, cpu, out.decode(errors="replace").strip()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--prompt", default=PROMPT)
    ap.add_argument("--extra", default="", help="more flags for `run`, space-separated")
    ap.add_argument("binaries", nargs="+")
    a = ap.parse_args()
    extra = a.extra.split()
    texts = {}
    for b in a.binaries:
        texts[b] = one(b, a.model, a.prompt, extra)[3]
    res = {b: ([], [], []) for b in a.binaries}
    for _ in range(a.rounds):
        for b in a.binaries:
            first, wall, cpu, text = one(b, a.model, a.prompt, extra)
            if text != texts[b]:
                sys.exit(f"{b}: greedy reply changed between runs: {texts[b]!r} then {text!r}")
            res[b][0].append(first)
            res[b][1].append(wall)
            res[b][2].append(cpu)
    if len(set(texts.values())) > 1:
        print(f"note: the binaries reply differently: {texts}")
    for b in a.binaries:
        f, w, c = res[b]
        m = statistics.median
        print(f"{b}: first byte median {m(f):.3f} s (min {min(f):.3f}, max {max(f):.3f}); "
              f"wall median {m(w):.3f} s (min {min(w):.3f}); cpu median {m(c):.3f} s (min {min(c):.3f}); "
              f"{a.rounds} runs, reply {texts[b]!r}")
    with open("/proc/loadavg") as f:
        print(f"load average at the end: {f.read().split()[0]}")


if __name__ == "__main__":
    main()
