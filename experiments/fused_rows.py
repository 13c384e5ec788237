"""Fused decoder layers vs the per-op path by pass shape (batch rows B x new tokens T) and context, the
embedded target, interleaved, medians of 7 passes (what kernels.MAX_FUSED rests on).

    OMP_NUM_THREADS=1 python experiments/fused_rows.py [--max-fused 128 --shapes 16x4,16x5,32x4,64x2]
"""
import argparse
import statistics
import time

import torch

torch.set_num_threads(1)
from verispec import kernels
from verispec.loading import load_pair

ap = argparse.ArgumentParser()
ap.add_argument("--max-fused", type=int, default=64, help="kernels.MAX_FUSED for this run")
ap.add_argument("--shapes", default="1x1,1x4,1x8,1x16,1x32,8x4,16x4,32x2,64x1,1x64", help="BxT pass shapes")
args = ap.parse_args()
kernels.MAX_FUSED = kernels.MAX_FUSED_AMX = args.max_fused  # let every shape below take the fused path when FUSED_LAYERS is on
target = load_pair("tiny", need_draft=False).target
shapes = [tuple(int(v) for v in shape.split("x")) for shape in args.shapes.split(",")]
for context in (150, 600):
    for batch, new in shapes:
        cache = target.new_cache(batch, 1024)
        for row in range(batch):
            view = cache.row_view(row)
            target.forward(torch.randint(0, 8000, (1, context)), view)
            view.commit(0, context)
            cache.sync_row(row, view)
        tokens = torch.randint(0, 8000, (batch, new))
        times = {False: [], True: []}
        for _ in range(7):
            for fused in (False, True):
                kernels.FUSED_LAYERS = fused
                began = time.perf_counter()
                target.forward(tokens, cache)
                times[fused].append(1e3 * (time.perf_counter() - began))
        per_op, fused = statistics.median(times[False]), statistics.median(times[True])
        print(f"context {context:4d}  B {batch:2d} x T {new:2d} = {batch * new:3d} rows: per-op {per_op:7.2f} ms, "
              f"fused {fused:7.2f} ms, fused/per-op {fused / per_op:.2f}", flush=True)
