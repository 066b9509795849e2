#!/usr/bin/env python3
"""Compile the CUDA kernels (crates/cuda/src/ops/*.cu, concatenated as crates/cuda/src/compile.rs
does) with NVRTC and ptxas for sm_90 on a machine without a GPU, and print each kernel's
registers, shared memory and spills: a compile error or a spill shows up before any device time.

NVRTC and ptxas come from NVIDIA's PyPI wheels (CUDA 12.9; the kernels' runtime NVRTC is CUDA 13,
so this is a check, not the cubin the backend loads):

    pip download --no-deps nvidia-cuda-nvrtc-cu12==12.9.86 nvidia-cuda-nvcc-cu12==12.9.86 -d W
    for f in W/*.whl; do unzip -q -o "$f" -d W/x; done
    python3 tools/cuda_ptxas.py --wheels W/x [NAME=VALUE ...]   # NAME=VALUE: a kernel define

The defines default to compile.rs's defaults (QV_R 2, QV_U 2, QV_STAGE 2, DC_R2 4, QT_TERMS 3,
QV_PF 1). Exit status 1 on a compile or ptxas error.
"""
import argparse
import ctypes
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULTS = {"QV_R": 2, "QV_U": 2, "QV_STAGE": 2, "DC_R2": 4, "QT_TERMS": 3, "QV_PF": 1}


def source(defines: dict) -> str:
    comp = (REPO / "crates/cuda/src/compile.rs").read_text()
    names = re.findall(r'\("([a-z_0-9]+\.cuh?)", include_str!', comp)
    src = "".join(f"#define {k} {v}\n" for k, v in defines.items())
    for n in names:
        src += f'#line 1 "{n}"\n' + (REPO / "crates/cuda/src/ops" / n).read_text() + "\n"
    return src


def nvrtc_ptx(lib: Path, src: str, arch: str) -> bytes:
    nv = ctypes.CDLL(str(lib))
    prog = ctypes.c_void_p()
    nv.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b"mference.cu", 0, None, None)
    opts = [f"--gpu-architecture=compute_{arch}".encode(), b"--std=c++17"]
    rc = nv.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    n = ctypes.c_size_t()
    nv.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
    log = ctypes.create_string_buffer(n.value)
    nv.nvrtcGetProgramLog(prog, log)
    if log.value.strip():
        print(log.value.decode(), file=sys.stderr)
    if rc != 0:
        sys.exit(f"NVRTC failed ({rc})")
    nv.nvrtcGetPTXSize(prog, ctypes.byref(n))
    ptx = ctypes.create_string_buffer(n.value)
    nv.nvrtcGetPTX(prog, ptx)
    return ptx.value


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--wheels", type=Path, required=True, help="the unzipped wheels (W/x above)")
    ap.add_argument("--arch", default="90")
    ap.add_argument("defines", nargs="*", help="NAME=VALUE kernel defines")
    a = ap.parse_args()
    defines = dict(DEFAULTS)
    for d in a.defines:
        k, v = d.split("=", 1)
        defines[k] = v
    ptx = nvrtc_ptx(a.wheels / "nvidia/cuda_nvrtc/lib/libnvrtc.so.12", source(defines), a.arch)
    out = Path("/tmp/mference_kernels.ptx")
    out.write_bytes(ptx)
    r = subprocess.run([str(a.wheels / "nvidia/cuda_nvcc/bin/ptxas"), f"-arch=sm_{a.arch}", "-v",
                        str(out), "-o", "/tmp/mference_kernels.cubin"], capture_output=True, text=True)
    fn = None
    for line in r.stderr.splitlines():
        m = re.search(r"Compiling entry function '(\w+)'", line)
        if m:
            fn = m.group(1)
        elif fn and "Used" in line:
            print(f"{fn:36s} {line.split('Used', 1)[1].strip()}")
        elif fn and "spill" in line and "0 bytes spill stores, 0 bytes spill loads" not in line:
            print(f"{fn:36s} SPILLS: {line.strip()}")
    if r.returncode != 0:
        print(r.stderr, file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
