"""The kernel's two bf16 paths on one CPU, per projection shape of the embedded pair and rows M:
AMX tiles (weights pre-tiled) against the AVX2 loop (row-major bf16) and torch's fp32 GEMM (what a
layer takes beyond the kernel's row limit), microseconds per call (median of 5 timings of 300 calls,
weights warm in cache), the largest error against a float64 product, and
whether each row's result is bit-identical alone and among the others.

    OMP_NUM_THREADS=1 python experiments/amx_linear.py     (needs a CPU with AMX-BF16)
"""
import statistics, sys, time
import torch
torch.set_num_threads(1)
from verispec import kernels

if not kernels.amx():
    sys.exit(f"no AMX path here: {kernels.status()} / {kernels._amx_reason}")


def timed(call, n=300):
    for _ in range(20):
        call()
    runs = []
    for _ in range(5):
        began = time.perf_counter()
        for _ in range(n):
            call()
        runs.append((time.perf_counter() - began) / n * 1e6)
    return statistics.median(runs)


for out_features, in_features in [(1024, 384), (768, 384), (384, 1024), (8192, 384), (8192, 256), (2048, 256)]:
    weight = torch.randn(out_features, in_features).bfloat16()
    tiled, fp32 = kernels._pack_weight(weight.float()), weight.float()
    assert tiled.dtype == torch.int16
    for rows in (1, 2, 8, 9, 16, 32, 64, 128):
        x = torch.randn(rows, in_features)
        exact = x.double() @ weight.double().T
        amx, avx2 = kernels.linear(x, tiled), kernels.linear(x, weight)
        alone = all(torch.equal(kernels.linear(x[r:r + 1], tiled)[0], amx[r]) for r in (0, rows - 1))
        print(f"N{out_features:>5} K{in_features:>5} M{rows:>3}: AMX {timed(lambda: kernels.linear(x, tiled)):7.1f} us"
              f"  AVX2 {timed(lambda: kernels.linear(x, weight)):7.1f} us"
              f"  torch fp32 {timed(lambda: torch.nn.functional.linear(x, fp32)):7.1f} us  max error AMX "
              f"{(amx.double() - exact).abs().max():.1e} AVX2 {(avx2.double() - exact).abs().max():.1e}"
              f"  rows independent {alone}", flush=True)
