"""Where a draft decode step goes: median step time at context 16/128/512, then cProfile of 300 steps
(the few-row kernel calls vs Python and torch dispatch).

    OMP_NUM_THREADS=1 python experiments/draft_step_profile.py
"""
import cProfile
import pstats
import statistics
import time

import torch
torch.set_num_threads(1)
from verispec.loading import load_pair
from verispec.sampling import draw_draft
from verispec.config import SamplingParams
pair = load_pair("tiny")
d = pair.draft
def med(f, n=200):
    ts=[]
    for _ in range(n):
        a=time.perf_counter(); f(); ts.append(time.perf_counter()-a)
    return 1e3*statistics.median(ts)
for ctx in (16, 128, 512):
    cache = d.new_cache(1, 1024)
    with torch.inference_mode():
        d.forward(torch.randint(0, 8000, (1, ctx)), cache); cache.commit(0, ctx)
    x = torch.tensor([[5]])
    def step():
        with torch.inference_mode():
            out = d.forward(x, cache, last_only=True)[0, -1].cpu()
        return out
    def step_noinf():
        return d.forward(x, cache, last_only=True)[0, -1].cpu()
    print(ctx, "forward ms", round(med(step), 3), "no-inference-mode", round(med(step_noinf),3))
logits = torch.randn(8192)
g = torch.Generator().manual_seed(0)
print("draw_draft greedy ms", round(med(lambda: draw_draft(logits, SamplingParams(temperature=0), g)), 4))
cache = d.new_cache(1, 1024)
with torch.inference_mode():
    d.forward(torch.randint(0, 8000, (1, 128)), cache); cache.commit(0, 128)
x = torch.tensor([[5]])
def step():
    with torch.inference_mode():
        return d.forward(x, cache, last_only=True)[0, -1].cpu()
for _ in range(50): step()
pr = cProfile.Profile(); pr.enable()
for _ in range(300): step()
pr.disable()
pstats.Stats(pr).sort_stats("tottime").print_stats(15)
