"""The kernel's GGUF Q4_1 rows against torch's fp32 GEMM of a same-shaped fp32 weight, from 16 to 64 input
rows, interleaved call by call in one process: median ms of each. Weights stay in cache between calls (the
same matrix each time), which favours torch: its fp32 weight has ~6x the bytes of Q4_1 and would stream from
memory in a model pass. Decides MAX_ROWS_BLOCKS in verispec/kernels/__init__.py.

    OMP_NUM_THREADS=1 python experiments/blocks_vs_torch.py [--calls 60] [--rows 16,17,24,32,48,64]
"""
import argparse
import ctypes
import statistics
import time

import numpy as np
import torch

from verispec import kernels

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--calls", type=int, default=60)
parser.add_argument("--rows", default="16,17,24,32,48,64")
parser.add_argument("--shapes", default="1536x576,576x1536,8192x576", help="comma-separated N x K")
args = parser.parse_args()
torch.set_num_threads(1)
lib = kernels.library()
rng = np.random.default_rng(0)
for shape in args.shapes.split(","):
    n, k = (int(v) for v in shape.split("x"))
    blocks = rng.integers(0, 256, (n, k // 32, 20)).astype(np.uint8)  # Q4_1: fp16 d, fp16 m, 16 nibble bytes
    scales = rng.uniform(0.001, 0.02, (n, k // 32, 2)).astype(np.float16)
    scales[..., 1] = -8 * scales[..., 0]
    blocks[..., :4] = scales.view(np.uint8)
    weight, dense = blocks.reshape(n, -1).copy(), torch.randn(n, k)
    for rows in (int(r) for r in args.rows.split(",")):
        x = rng.standard_normal((rows, k)).astype(np.float32)
        y, xt = np.zeros((rows, n), np.float32), torch.from_numpy(x)
        kernel_ms, torch_ms = [], []
        for _ in range(args.calls):
            began = time.perf_counter()
            lib.small_m_linear(ctypes.c_void_p(x.ctypes.data), ctypes.c_void_p(weight.ctypes.data), 5,
                               ctypes.c_void_p(y.ctypes.data), None, rows, k, n, 1)
            kernel_ms.append(1e3 * (time.perf_counter() - began))
            began = time.perf_counter()
            torch.nn.functional.linear(xt, dense)
            torch_ms.append(1e3 * (time.perf_counter() - began))
        print(f"{n}x{k} {rows} rows: kernel Q4_1 {statistics.median(kernel_ms):.3f} ms  "
              f"torch fp32 {statistics.median(torch_ms):.3f} ms", flush=True)
