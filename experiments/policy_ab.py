"""The adaptive policy of an older git revision against today's, on the same BatchEngine at
concurrency 1 (the 66 prompts of the serving sweep one after another, greedy): per repeat, plain
decoding, each policy fresh (its first pass over the prompts) and learned (a second pass), in
output tokens/s.

    OMP_NUM_THREADS=1 python experiments/policy_ab.py REV [--repeats 3]
    e.g.  f235596   (the draft's reads priced; before the load hold, climb tolerance, re-measure fix)
"""
import argparse, importlib.util, subprocess, sys, tempfile, time
import torch
torch.set_num_threads(1)
from verispec.adaptive import AdaptiveGamma
from verispec.batch import BatchEngine, BatchRequest
from verispec.bench.config import PromptSettings
from verispec.bench.workloads import build_prompt_set
from verispec.config import SamplingParams, SpecConfig, StopRules
from verispec.loading import load_pair

ap = argparse.ArgumentParser()
ap.add_argument("rev")
ap.add_argument("--repeats", type=int, default=3)
args = ap.parse_args()
source = subprocess.run(["git", "show", f"{args.rev}:verispec/adaptive.py"], check=True, capture_output=True,
                        text=True).stdout
path = tempfile.NamedTemporaryFile("w", suffix=".py", delete=False)
path.write(source); path.close()
spec = importlib.util.spec_from_file_location("adaptive_then", path.name)
then = importlib.util.module_from_spec(spec); sys.modules["adaptive_then"] = then; spec.loader.exec_module(then)

pair = load_pair("tiny")
prompts = build_prompt_set(PromptSettings(workloads=("sharegpt", "code", "math"), per_workload=22,
                                          max_output_tokens=48), pair.tokenizer, 1024, 6)
greedy = SamplingParams(temperature=0)

def engine(policy):
    spec = SpecConfig(method="chain", gamma=4) if policy else SpecConfig(method="none")
    return BatchEngine(pair.target, pair.draft, spec, max_batch=64, gamma_policy=policy)

def run(e):
    began, tokens = time.perf_counter(), 0
    for p in prompts:
        request = BatchRequest(p.prompt_id, list(p.prompt_ids), greedy, StopRules(max_tokens=p.max_tokens, ignore_eos=True))
        tokens += sum(len(x.tokens) for x in e.add(request))
        while e.active:
            tokens += sum(len(x.tokens) for x in e.step())
    return tokens / (time.perf_counter() - began)

for repeat in range(args.repeats):
    engines = {"off": engine(None), "now": engine(AdaptiveGamma(max_gamma=4)),
               args.rev: engine(then.AdaptiveGamma(max_gamma=4))}
    line = {"off": run(engines["off"])}
    for name in ("now", args.rev):
        line[f"{name} fresh"] = run(engines[name])
    for name in ("now", args.rev):
        line[f"{name} learned"] = run(engines[name])
    print(f"repeat {repeat}: " + "  ".join(f"{k} {v:.0f}" for k, v in line.items()), flush=True)
