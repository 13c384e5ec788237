"""Dynamic trees against the chain at matched verification budget D, greedy, on planner_check's 12
evaluation prompts (96 tokens each), after each engine has run the 12 calibration prompts once (the
dynamic builder's acceptance calibration learns there, as a server's would over its first requests):
committed tokens per round and decode tokens/s (prefill excluded), one pass each.

    OMP_NUM_THREADS=1 python experiments/dynamic_vs_chain.py [--budgets 5,6,7]
"""
import argparse
import torch
torch.set_num_threads(1)
from verispec.bench.planner_check import split_prompts
from verispec.config import SamplingParams, SpecConfig, StopRules
from verispec.loading import build_engine, load_pair, resolve_draft_vocab

ap = argparse.ArgumentParser()
ap.add_argument("--budgets", default="5,6,7")
args = ap.parse_args()
pair = load_pair("tiny")
vocab = resolve_draft_vocab(pair, "auto")
evaluation, calibration = split_prompts(pair.tokenizer, 4, pair.target.config.max_context - 140)
greedy, stop = SamplingParams(temperature=0), StopRules(max_tokens=96, ignore_eos=True)
for budget in (int(b) for b in args.budgets.split(",")):
    line = []
    for name, spec in (("chain", SpecConfig(gamma=budget - 1, draft_vocab=vocab)),
                       ("dynamic", SpecConfig(method="tree", tree=f"dynamic:{budget}", draft_vocab=vocab))):
        engine = build_engine(pair, spec)
        for prompt in calibration:
            engine.generate(prompt, greedy, spec, stop)
        committed = rounds = tokens = 0
        seconds = 0.0
        for prompt in evaluation:
            stats = engine.generate(prompt, greedy, spec, stop).stats
            committed += sum(r.committed for r in stats.rounds)
            rounds += len(stats.rounds)
            seconds += stats.e2e_s - stats.ttft_s
            tokens += stats.generated_tokens - 1
        line.append(f"{name} {committed / rounds:.3f} committed/round, {tokens / seconds:.0f} tok/s")
    print(f"D = {budget}: " + "; ".join(line), flush=True)
