"""Draft cost per gamma-4 round, BatchEngine (one request at a time, max batch 1 and 64) against
SpecEngine on the same 6 held-out prompts; medians over rounds, one run.

    OMP_NUM_THREADS=1 python experiments/batch_vs_single_draft.py
"""
import time, torch, statistics
torch.set_num_threads(1)
from verispec.batch import BatchEngine, BatchRequest
from verispec.config import SamplingParams, SpecConfig, StopRules
from verispec.loading import load_pair, build_engine
from verispec.bench.planner_check import split_prompts
pair = load_pair("tiny")
ev, _ = split_prompts(pair.tokenizer, 2, 512)
spec = SpecConfig(method="chain", gamma=4)
for mb in (1, 64):
    eng = BatchEngine(pair.target, pair.draft, spec, max_batch=mb)
    eng.add(BatchRequest("w", ev[0], SamplingParams(temperature=0), StopRules(max_tokens=8, ignore_eos=True)))
    while eng.active: eng.step()
    for i, p in enumerate(ev):
        eng.add(BatchRequest(str(i), p, SamplingParams(temperature=0), StopRules(max_tokens=64, ignore_eos=True)))
        while eng.active: eng.step()
    # per-round split from stats? time directly
    t=[];
    orig = eng.draft.propose
    def prop(rows, n):
        a=time.perf_counter(); r=orig(rows, n); t.append(time.perf_counter()-a); return r
    eng.draft.propose = prop
    for i, p in enumerate(ev):
        eng.add(BatchRequest(str(i), p, SamplingParams(temperature=0), StopRules(max_tokens=64, ignore_eos=True)))
        while eng.active: eng.step()
    print("max_batch", mb, "batch draft ms/round median", round(1e3*statistics.median(t),2), len(t))
se = build_engine(pair, spec)
res = [se.generate(p, SamplingParams(temperature=0), spec, StopRules(max_tokens=64, ignore_eos=True)) for p in ev]
d = [r.draft_s for x in res for r in x.stats.rounds if r.drafted == 4]
print("SpecEngine draft ms/round median", round(1e3*statistics.median(d),2))
