"""Few-row products of the kernel's weight formats (fp32, bf16, int8 rows, GGUF Q4_1 and Q8_0 blocks), two
or more builds of its C source interleaved call by call in one process: median ms of each build per format
and shape, the lane FMAs a second that makes, and whether every build gives the same bits. One input row by
default (decode's shape); --rows 8 is an 8-position verification's. A build is a git revision, WORK (the
file on disk) or a copy of the source (a path ending in .c), optionally with compiler flags
(WORK:-DPANEL_K=512), as in kernel_ab.py, which compares whole model passes instead.

    OMP_NUM_THREADS=1 python experiments/one_row_ab.py BEFORE AFTER [--calls 300] [--rows 1] [--formats q4_1]
        [--shapes 1536x576,576x1536]
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

FORMATS = {0: "fp32", 1: "bf16", 3: "int8", 5: "q4_1", 6: "q8_0"}  # the kernel's weight types (see run())
SHAPES = "1536x576,576x1536,8192x576"  # (N x K): SmolLM2's MLP in / out, a draft's LM head  # (N, K): SmolLM2's MLP in / out, a draft's LM head


def build(spec: str, folder: Path, index: int) -> ctypes.CDLL:
    revision, _, flags = spec.partition(":")  # REV or REV:-DNAME=VALUE ..., as in kernel_ab.py
    source = kernels.SOURCE.read_text() if revision == "WORK" else Path(revision).read_text() if revision.endswith(
        ".c") else subprocess.run(
        ["git", "show", f"{revision}:verispec/kernels/small_m_linear.c"], check=True, capture_output=True,
        text=True).stdout
    c_file, so_file = folder / f"build{index}.c", folder / f"build{index}.so"
    c_file.write_text(source)
    subprocess.run(["cc", *kernels.FLAGS, *flags.split(), "-o", str(so_file), str(c_file)], check=True)
    lib = ctypes.CDLL(str(so_file))
    lib.small_m_linear.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                   ctypes.c_long, ctypes.c_long, ctypes.c_long, ctypes.c_int]
    return lib


def weights(wt: int, n: int, k: int, rng) -> np.ndarray:
    if wt == 0:
        return rng.standard_normal((n, k)).astype(np.float32)
    if wt == 1:  # bf16: the top half of fp32
        return (rng.standard_normal((n, k)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    if wt in (5, 6):  # GGUF blocks of 32: fp16 d (and m for Q4_1), then 16 nibble bytes or 32 int8
        size = 20 if wt == 5 else 34
        blocks = rng.integers(0, 256, (n, k // 32, size)).astype(np.uint8)
        scales = rng.uniform(0.001, 0.02, (n, k // 32, 2 if wt == 5 else 1)).astype(np.float16)
        if wt == 5:
            scales[..., 1] = -8 * scales[..., 0]
        blocks[..., :2 * scales.shape[-1]] = scales.view(np.uint8)
        return blocks.reshape(n, k // 32 * size)
    rows = np.zeros((n, k + 4), np.uint8)  # int8 rows: an fp32 scale, then K values
    rows[:, :4] = np.full((n, 1), 0.01, np.float32).view(np.uint8)
    rows[:, 4:] = rng.integers(-127, 128, (n, k)).astype(np.int8).view(np.uint8)
    return rows


parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("builds", nargs="+", help="git revisions, WORK or a .c file, each optionally :-DNAME=VALUE ...")
parser.add_argument("--calls", type=int, default=300)
parser.add_argument("--shapes", default=SHAPES, help="comma-separated N x K (outputs x inputs)")
parser.add_argument("--rows", type=int, default=1, help="input rows M (1: decode; 8: an 8-position pass)")
parser.add_argument("--formats", default=",".join(FORMATS.values()), help="comma-separated, of " + ", ".join(
    FORMATS.values()))
args = parser.parse_args()
chosen = args.formats.split(",")
rng = np.random.default_rng(0)
with tempfile.TemporaryDirectory() as scratch:
    libs = {spec: build(spec, Path(scratch), i) for i, spec in enumerate(args.builds)}
    for wt, name in FORMATS.items():
        if name not in chosen:
            continue
        for n, k in (tuple(int(v) for v in shape.split("x")) for shape in args.shapes.split(",")):
            w, x = weights(wt, n, k, rng), rng.standard_normal((args.rows, k)).astype(np.float32)
            ys = {revision: np.zeros((args.rows, n), np.float32) for revision in libs}
            times = {revision: [] for revision in libs}
            for _ in range(args.calls):
                for revision, lib in libs.items():
                    began = time.perf_counter()
                    lib.small_m_linear(x.ctypes.data, w.ctypes.data, wt, ys[revision].ctypes.data, None, args.rows, k, n,
                                       1)
                    times[revision].append(1e3 * (time.perf_counter() - began))
            outputs = list(ys.values())
            same = all(np.array_equal(outputs[0], y) for y in outputs)
            print(f"{name} {n}x{k} x {args.rows} rows: " + "  ".join(
                f"{r} {statistics.median(t):.4f} ms ({args.rows * n * k / statistics.median(t) / 1e6:.1f} G FMA/s)"
                for r, t in times.items())
                  + ("  same bits" if same else "  DIFFERENT BITS"), flush=True)
