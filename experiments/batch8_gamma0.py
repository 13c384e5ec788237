"""Offline check of the adaptive policy at concurrency 8: off vs the draft held at gamma 0 vs adaptive,
interleaved, 6 repeats of 32 greedy 48-token requests.

    OMP_NUM_THREADS=1 python experiments/batch8_gamma0.py
"""
import time, torch, statistics
torch.set_num_threads(1)
from verispec.batch import BatchEngine, BatchRequest
from verispec.adaptive import AdaptiveGamma, FixedGamma
from verispec.config import SamplingParams, SpecConfig, StopRules
from verispec.loading import load_pair
from verispec.bench.planner_check import split_prompts
pair = load_pair("tiny")
ev, cal = split_prompts(pair.tokenizer, 6, 512)
prompts = ev + cal
G = SamplingParams(temperature=0)
def run(engine, conc=8, n=32):
    queue = [BatchRequest(str(i), prompts[i % len(prompts)], G, StopRules(max_tokens=48, ignore_eos=True)) for i in range(n)]
    t = time.perf_counter(); tokens = 0
    while queue or engine.active:
        while queue and engine.active < conc:
            for e in engine.add(queue.pop(0)): tokens += len(e.tokens)
        for e in engine.step(): tokens += len(e.tokens)
    return tokens / (time.perf_counter() - t)
import collections
engines = {
  "off": BatchEngine(pair.target, None, SpecConfig(method="none"), max_batch=64),
  "draft@g0": BatchEngine(pair.target, pair.draft, SpecConfig(gamma=4), max_batch=64, gamma_policy=FixedGamma(0)),
  "adaptive": BatchEngine(pair.target, pair.draft, SpecConfig(gamma=4), max_batch=64, gamma_policy=AdaptiveGamma(max_gamma=4)),
}
pol = engines["adaptive"].gamma_policy
cnt = collections.Counter()
orig = pol.observe
def obs(b, g, s, a, d):
    cnt[(pol.bucket(b), g)] += 1
    return orig(b, g, s, a, d)
pol.observe = obs
res = {k: [] for k in engines}
for rep in range(6):
    for k, e in engines.items():
        res[k].append(run(e))
    print(rep, {k: round(v[-1], 1) for k, v in res.items()}, flush=True)
print({k: round(statistics.median(v), 1) for k, v in res.items()})
print(sorted(cnt.items()))
