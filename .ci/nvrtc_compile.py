#!/usr/bin/env python3
"""Compile CUDA C++ kernel sources to PTX with NVRTC, through ctypes.

Usage: nvrtc_compile.py --lib LIBNVRTC --arch compute_90 --out DIR FILE.cu...

Writes DIR/<stem>.ptx for every source. The options are the ones the
runtime passes (crates/gpu-runtime/src/cuda/nvrtc.rs, OPTIONS), so what
compiles here compiles there. Exits 1 naming the file and printing NVRTC's
log when a source does not compile.
"""

import argparse
import ctypes
import os
import sys

# Keep in step with OPTIONS in crates/gpu-runtime/src/cuda/nvrtc.rs.
OPTIONS = ["--fmad=false", "--std=c++17", "-default-device"]


def check(lib, res, call):
    if res != 0:
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        msg = lib.nvrtcGetErrorString(res).decode()
        raise RuntimeError(f"{call} failed: {msg} ({res})")


def compile_one(lib, path, arch):
    with open(path, "rb") as f:
        src = f.read()
    prog = ctypes.c_void_p()
    name = os.path.basename(path).encode()
    check(
        lib,
        lib.nvrtcCreateProgram(ctypes.byref(prog), src, name, 0, None, None),
        "nvrtcCreateProgram",
    )
    try:
        opts = [f"--gpu-architecture={arch}".encode()] + [o.encode() for o in OPTIONS]
        arr = (ctypes.c_char_p * len(opts))(*opts)
        res = lib.nvrtcCompileProgram(prog, len(opts), arr)
        size = ctypes.c_size_t()
        check(lib, lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size)), "nvrtcGetProgramLogSize")
        log = ctypes.create_string_buffer(size.value)
        check(lib, lib.nvrtcGetProgramLog(prog, log), "nvrtcGetProgramLog")
        log = log.value.decode(errors="replace").strip()
        if res != 0:
            raise RuntimeError(f"{path}: nvrtcCompileProgram failed ({res}); log:\n{log}")
        if log:
            print(f"{path}: NVRTC log:\n{log}", file=sys.stderr)
        check(lib, lib.nvrtcGetPTXSize(prog, ctypes.byref(size)), "nvrtcGetPTXSize")
        ptx = ctypes.create_string_buffer(size.value)
        check(lib, lib.nvrtcGetPTX(prog, ptx), "nvrtcGetPTX")
        return ptx.value
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", required=True)
    ap.add_argument("--arch", default="compute_90")
    ap.add_argument("--out", required=True)
    ap.add_argument("files", nargs="+")
    a = ap.parse_args()
    lib = ctypes.CDLL(a.lib)
    major, minor = ctypes.c_int(), ctypes.c_int()
    check(lib, lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
    print(f"NVRTC {major.value}.{minor.value}, {a.arch}, options {' '.join(OPTIONS)}")
    os.makedirs(a.out, exist_ok=True)
    failed = False
    for path in a.files:
        try:
            ptx = compile_one(lib, path, a.arch)
        except RuntimeError as e:
            print(f"error: {e}", file=sys.stderr)
            failed = True
            continue
        stem = os.path.splitext(os.path.basename(path))[0]
        with open(os.path.join(a.out, stem + ".ptx"), "wb") as f:
            f.write(ptx)
        print(f"{path}: {len(ptx)} bytes of PTX")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
