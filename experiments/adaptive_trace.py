"""What the adaptive gamma policy believes and does at batch 1: after the planner check's 18 calibration
prompts, its round-time estimate (ms) and sample count per candidate gamma and its predicted rate, then
per evaluation prompt (3 passes over 6) how many rounds drafted how many tokens.

    OMP_NUM_THREADS=1 python experiments/adaptive_trace.py
"""
import collections, torch
torch.set_num_threads(1)
from verispec.bench.planner_check import split_prompts
from verispec.config import SamplingParams, SpecConfig, StopRules
from verispec.loading import load_pair, build_engine
pair = load_pair("tiny")
ev, cal = split_prompts(pair.tokenizer, 2, 512)
spec = SpecConfig(method="chain", gamma=8, gamma_policy="adaptive")
engine = build_engine(pair, spec)
pol = engine.gamma_policy
G, stop = SamplingParams(temperature=0), StopRules(max_tokens=64, ignore_eos=True)
engine.generate(ev[0], G, spec, StopRules(max_tokens=8, ignore_eos=True))
for p in cal: engine.generate(p, G, spec, stop)
def show():
    print("  round ms:", {g: round(1e3 * pol.round_seconds[(1, g)], 2) for g in pol.candidates if (1, g) in pol.round_seconds},
          "samples", {g: pol.samples.get((1, g)) for g in pol.candidates},
          "prompt reads ms/token", round(1e3 * pol.prompt_seconds_per_token(), 4))
    acc = pol.acceptance()
    print("  rate:", {g: round(pol.predicted_rate(1, g, acc) or 0, 1) for g in pol.candidates})
show()
for rep in range(3):
    for i, p in enumerate(ev):
        r = engine.generate(p, G, spec, stop)
        print(rep, i, dict(sorted(collections.Counter(x.drafted for x in r.stats.rounds).items())))
    show()
