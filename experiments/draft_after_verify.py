"""A draft step in a decoding loop's shadow: the draft's weights are evicted from the CPU cache by each
target pass. Median ms of a draft decode step (300 slots of context) alone, then of the 1st..4th draft
steps right after a 4-position target verification, then of 2 steps after a 64 MB memory sweep.

    OMP_NUM_THREADS=1 python experiments/draft_after_verify.py
"""
import statistics
import time

import torch

torch.set_num_threads(1)
from verispec.loading import load_pair

pair = load_pair("tiny")
target, draft = pair.target, pair.draft
target_cache, draft_cache = target.new_cache(1, 1024), draft.new_cache(1, 1024)
prompt = torch.randint(0, 8000, (1, 300))
target.forward(prompt, target_cache)
target_cache.commit(0, 300)
draft.forward(prompt, draft_cache)
draft_cache.commit(0, 300)
token, block = torch.tensor([[5]]), torch.tensor([[5, 6, 7, 8]])


def timed(step) -> float:
    began = time.perf_counter()
    step()
    return 1e3 * (time.perf_counter() - began)


def draft_step():
    draft.forward(token, draft_cache, last_only=True)  # nothing committed: the same slot every time


alone = [timed(draft_step) for _ in range(300)]
after = [[] for _ in range(4)]
for _ in range(200):
    target.forward(block, target_cache)
    for position in range(4):
        after[position].append(timed(draft_step))
sweep, swept = torch.empty(64 * 1024 * 1024 // 4), [[], []]
for _ in range(200):
    sweep.sum()
    for position in range(2):
        swept[position].append(timed(draft_step))
print(f"draft step alone: {statistics.median(alone):.3f} ms")
print("draft steps 1..4 after a target verify(4):", [round(statistics.median(v), 3) for v in after])
print("draft steps 1..2 after a 64 MB sweep:", [round(statistics.median(v), 3) for v in swept])
