#!/usr/bin/env python3
"""Compiles the CUDA kernels (gpu/kernels/llama.cu + gemv.cu, one unit, as the backend does at
start) with NVRTC for each architecture given, then assembles the PTX with ptxas and prints
registers, shared memory and spills per kernel. Machines without a GPU can run it: NVRTC, the
CUDA headers and ptxas come from NVIDIA's PyPI wheels (scripts/check-kernels.sh fetches them).
It also checks that every kernel the backend loads by name (`f("...")` in
gpu/src/cuda/device.rs) is an entry of the module, so a renamed kernel fails here rather than at
start on a GPU host.

usage: check-kernels.py CUDA_DIR [sm_90 sm_80 ...]
CUDA_DIR holds nvidia/cuda_nvrtc/lib, nvidia/cuda_runtime/include and nvidia/cuda_nvcc/bin.
Exit status 1 on any compile or assembly error.
"""
import ctypes
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main():
    cuda = sys.argv[1]
    archs = sys.argv[2:] or ["sm_90"]
    lib = ctypes.CDLL(os.path.join(cuda, "nvidia/cuda_nvrtc/lib/libnvrtc.so.12"))
    include = os.path.join(cuda, "nvidia/cuda_runtime/include")
    ptxas = os.path.join(cuda, "nvidia/cuda_nvcc/bin/ptxas")
    # The same unit and options as gpu/src/cuda/device.rs (KERNELS, compile_options).
    src = "\n".join(open(os.path.join(ROOT, "gpu/kernels", f)).read() for f in ("llama.cu", "gemv.cu"))
    device_rs = open(os.path.join(ROOT, "gpu/src/cuda/device.rs")).read()
    loaded = sorted(set(re.findall(r'\bf\("([A-Za-z0-9_]+)"\)', device_rs)))
    if not loaded:
        sys.exit("no kernel names found in gpu/src/cuda/device.rs")
    failed = False
    for arch in archs:
        prog = ctypes.c_void_p()
        if lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b"kernels.cu", 0, None, None):
            sys.exit("nvrtcCreateProgram failed")
        opts = [f"--gpu-architecture={arch}", f"--include-path={include}", "--std=c++17", "-lineinfo"]
        # Extra options for source variants (e.g. NVRTC_DEFINES="-DMMA_KEYS=32").
        opts += os.environ.get("NVRTC_DEFINES", "").split()
        arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
        rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
        n = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
        log = ctypes.create_string_buffer(n.value)
        lib.nvrtcGetProgramLog(prog, log)
        text = log.value.decode(errors="replace").strip()
        if text:
            print(text)
        if rc != 0:
            print(f"{arch}: NVRTC failed ({rc})")
            failed = True
            continue
        lib.nvrtcGetPTXSize(prog, ctypes.byref(n))
        ptx = ctypes.create_string_buffer(n.value)
        lib.nvrtcGetPTX(prog, ptx)
        entries = set(re.findall(r"\.entry ([A-Za-z0-9_]+)\(", ptx.value.decode(errors="replace")))
        missing = [k for k in loaded if k not in entries]
        if missing:
            print(f"{arch}: the backend loads kernels the module lacks: {', '.join(missing)}")
            failed = True
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "k.ptx")
            open(path, "wb").write(ptx.value)
            cubin = os.path.join(tmp, "k.cubin")
            r = subprocess.run([ptxas, f"-arch={arch}", "-v", path, "-o", cubin],
                               capture_output=True, text=True)
            # CUBIN_OUT=DIR keeps DIR/ARCH.cubin (to compare machine code between versions).
            if r.returncode == 0 and os.environ.get("CUBIN_OUT"):
                os.makedirs(os.environ["CUBIN_OUT"], exist_ok=True)
                shutil.copy(cubin, os.path.join(os.environ["CUBIN_OUT"], f"{arch}.cubin"))
        if r.returncode != 0:
            print(r.stderr)
            print(f"{arch}: ptxas failed")
            failed = True
            continue
        # "Compiling entry function 'x'" then "... spill ..." and "Used N registers ..." lines.
        rows, name, spill = [], None, ""
        for line in r.stderr.splitlines():
            if "Compiling entry function" in line:
                name = line.split("'")[1]
            elif "spill" in line and name:
                spill = line.strip()
            elif "Used" in line and name:
                rows.append(f"  {name:28} {line.split(':', 1)[1].strip()}; {spill}")
                name, spill = None, ""
        print(f"{arch}: {len(rows)} kernels")
        print("\n".join(rows))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
