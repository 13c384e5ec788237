"""Fused decoder layers vs the per-op path by pass shape (batch rows B x new tokens T) and context, the
embedded target, interleaved, medians of 7 passes (README: the 32-row limit, kernels.MAX_FUSED).

    OMP_NUM_THREADS=1 python docs/experiments/fused_rows.py
"""
import statistics
import time

import torch

torch.set_num_threads(1)
from verispec import kernels
from verispec.loading import load_pair

kernels.MAX_FUSED = 64  # let every shape below take the fused path when FUSED_LAYERS is on
target = load_pair(need_draft=False).target
for context in (150, 600):
    for batch, new in ((1, 1), (1, 4), (1, 8), (1, 16), (1, 32), (8, 4), (16, 4), (32, 2), (64, 1), (1, 64)):
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
