"""One-row products (decode's shape) of the kernel's fp32, bf16 and int8 weight rows, two or more builds of
its C source interleaved call by call in one process: median ms of each build per format and shape, and
whether every build gives the same bits. A build is a git revision or WORK (the file on disk), as in
kernel_ab.py, which compares whole model passes instead.

    OMP_NUM_THREADS=1 python experiments/one_row_ab.py BEFORE AFTER [--calls 300]
"""
import argparse
import ctypes
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

from verispec import kernels

FORMATS = {0: "fp32", 1: "bf16", 3: "int8"}  # the kernel's weight types (see run() in the C source)
SHAPES = [(1536, 576), (576, 1536), (8192, 576)]  # (N, K): SmolLM2's MLP in / out, a draft's LM head


def build(revision: str, folder: Path) -> ctypes.CDLL:
    source = kernels.SOURCE.read_text() if revision == "WORK" else subprocess.run(
        ["git", "show", f"{revision}:verispec/kernels/small_m_linear.c"], check=True, capture_output=True,
        text=True).stdout
    c_file, so_file = folder / f"{revision}.c", folder / f"{revision}.so"
    c_file.write_text(source)
    subprocess.run(["cc", *kernels.FLAGS, "-o", str(so_file), str(c_file)], check=True)
    lib = ctypes.CDLL(str(so_file))
    lib.small_m_linear.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                   ctypes.c_long, ctypes.c_long, ctypes.c_long, ctypes.c_int]
    return lib


def weights(wt: int, n: int, k: int, rng) -> np.ndarray:
    if wt == 0:
        return rng.standard_normal((n, k)).astype(np.float32)
    if wt == 1:  # bf16: the top half of fp32
        return (rng.standard_normal((n, k)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    rows = np.zeros((n, k + 4), np.uint8)  # int8 rows: an fp32 scale, then K values
    rows[:, :4] = np.full((n, 1), 0.01, np.float32).view(np.uint8)
    rows[:, 4:] = rng.integers(-127, 128, (n, k)).astype(np.int8).view(np.uint8)
    return rows


parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("builds", nargs="+", help="git revisions or WORK")
parser.add_argument("--calls", type=int, default=300)
args = parser.parse_args()
rng = np.random.default_rng(0)
with tempfile.TemporaryDirectory() as scratch:
    libs = {revision: build(revision, Path(scratch)) for revision in args.builds}
    for wt, name in FORMATS.items():
        for n, k in SHAPES:
            w, x = weights(wt, n, k, rng), rng.standard_normal((1, k)).astype(np.float32)
            ys = {revision: np.zeros((1, n), np.float32) for revision in libs}
            times = {revision: [] for revision in libs}
            for _ in range(args.calls):
                for revision, lib in libs.items():
                    began = time.perf_counter()
                    lib.small_m_linear(x.ctypes.data, w.ctypes.data, wt, ys[revision].ctypes.data, None, 1, k, n, 1)
                    times[revision].append(1e3 * (time.perf_counter() - began))
            outputs = list(ys.values())
            same = all(np.array_equal(outputs[0], y) for y in outputs)
            print(f"{name} {n}x{k}: " + "  ".join(f"{r} {statistics.median(t):.4f} ms" for r, t in times.items())
                  + ("  same bits" if same else "  DIFFERENT BITS"), flush=True)
