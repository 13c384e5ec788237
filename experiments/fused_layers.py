"""Whole decoder layers in one native call vs the per-op torch path (both with the few-row linear
kernel): plain decoding and chain speculation at gamma 3, interleaved per prompt, on the planner
check's 6 evaluation prompts (2 code, 2 chat, 2 math), greedy, 64 tokens, 5 repeats; decode ms per
token (prefill excluded) medians over repeats of the per-repeat mean.

    OMP_NUM_THREADS=1 python experiments/fused_layers.py
"""
import statistics

import torch

torch.set_num_threads(1)
from verispec import kernels
from verispec.bench.planner_check import split_prompts
from verispec.config import SamplingParams, SpecConfig, StopRules
from verispec.drafters.draft_model import DraftModelDrafter
from verispec.engine import SpecEngine
from verispec.loading import load_pair

pair = load_pair("tiny")
prompts, _ = split_prompts(pair.tokenizer, 2, 512)
greedy, stop = SamplingParams(temperature=0), StopRules(max_tokens=64, ignore_eos=True)
engine = SpecEngine(pair.target, DraftModelDrafter(pair.draft))
variants = {"off": SpecConfig(method="none"), "gamma 3": SpecConfig(gamma=3)}
ms = {(fused, name): [] for fused in (False, True) for name in variants}
outputs = {}
for repeat in range(5):
    per = {key: [] for key in ms}
    for prompt in prompts:
        for fused in (False, True):
            kernels.FUSED_LAYERS = fused
            for name, spec in variants.items():
                result = engine.generate(prompt, greedy, spec, stop)
                per[(fused, name)].append(1e3 / result.stats.decode_tokens_per_s)
                outputs.setdefault(tuple(prompt), set()).add(tuple(result.tokens))
    for key, values in per.items():
        ms[key].append(statistics.mean(values))
    print(repeat, {f"{'fused' if k[0] else 'per-op'} {k[1]}": round(v[-1], 2) for k, v in ms.items()}, flush=True)
print("every output identical across variants:", all(len(v) == 1 for v in outputs.values()))
med = {key: statistics.median(v) for key, v in ms.items()}
for fused in (False, True):
    label = "fused " if fused else "per-op"
    print(f"{label}: off {med[(fused, 'off')]:.2f} ms/token, gamma 3 {med[(fused, 'gamma 3')]:.2f} ms/token, "
          f"speedup {med[(fused, 'off')] / med[(fused, 'gamma 3')]:.3f}x")
print(f"fused vs per-op: off {med[(False, 'off')] / med[(True, 'off')]:.2f}x faster, "
      f"gamma 3 {med[(False, 'gamma 3')] / med[(True, 'gamma 3')]:.2f}x faster")
