"""Adaptive gamma policy variants against fixed gammas at batch 1, on planner_check's evaluation
prompts (the first --prompts held-out prompts per workload; the policies first run the calibration
prompts once, as there): decode ms per token (prefill excluded) per repeat, interleaved per prompt,
speedup over plain decoding = median over repeats of the per-repeat ratio.

    OMP_NUM_THREADS=1 python docs/experiments/policy_variants.py [--prompts 4] [--repeats 5] [--priors 2,4]

Variants: the default policy; per-request acceptance blended with more prior weight (prior_rounds
32 instead of 8); shared acceptance only (one gamma for every request); the default seeded from a
calibrated profile measured in this process (as `verispec serve --profile` does); transformers' +2 / -1
heuristic (``hf``), starting at 8; the default policy's bookkeeping with its choice pinned to gamma 4
(``pinned4``: against ``gamma4``, what the policy's own Python costs per round).
"""
import argparse, statistics, sys
import torch
torch.set_num_threads(1)
from verispec import profile as profiler
from verispec.adaptive import AdaptiveGamma, HFHeuristicGamma
from verispec.bench.planner_check import split_prompts
from verispec.config import SamplingParams, SpecConfig, StopRules
from verispec.loading import build_engine, load_pair, resolve_draft_vocab

ap = argparse.ArgumentParser()
ap.add_argument("--prompts", type=int, default=4)
ap.add_argument("--repeats", type=int, default=5)
ap.add_argument("--max-tokens", type=int, default=64)
ap.add_argument("--priors", default="", help="more variants: the default policy with these prior_rounds, e.g. 2,4")
args = ap.parse_args()

pair = load_pair()
vocab = resolve_draft_vocab(pair, "auto")
evaluation, calibration = split_prompts(pair.tokenizer, args.prompts, pair.target.config.max_context - 80)
greedy, stop = SamplingParams(temperature=0), StopRules(max_tokens=args.max_tokens, ignore_eos=True)
data = profiler.profile(pair.target, pair.draft, max_positions=9, repeats=11, tree_shapes=(), draft_vocab=vocab)
data["calibration"] = profiler.calibrate(build_engine(pair, SpecConfig(gamma=8, draft_vocab=vocab)), calibration, 8, args.max_tokens,
                                         plain_engine=build_engine(pair, SpecConfig(method="none")))


class Pinned4(AdaptiveGamma):
    def choose(self, batch_size, request=None):
        super().choose(batch_size, request)
        return 4


class SharedOnly(AdaptiveGamma):
    def choose(self, batch_size, request=None):
        return super().choose(batch_size, None)


def seeded():
    policy = AdaptiveGamma(max_gamma=8)
    profiler.seed_policy(policy, data)
    return policy


policies = {"adaptive": lambda: AdaptiveGamma(max_gamma=8), "prior32": lambda: AdaptiveGamma(max_gamma=8, prior_rounds=32),
            "shared": lambda: SharedOnly(max_gamma=8), "seeded": seeded,
            "hf": lambda: HFHeuristicGamma(initial=8), "pinned4": lambda: Pinned4(max_gamma=8)}
for weight in (int(w) for w in args.priors.split(",") if w):
    policies[f"prior{weight}"] = lambda weight=weight: AdaptiveGamma(max_gamma=8, prior_rounds=weight)
specs = {"off": SpecConfig(method="none"), **{f"gamma{g}": SpecConfig(gamma=g, draft_vocab=vocab) for g in (3, 4, 5, 6)},
         **{name: SpecConfig(gamma=8, gamma_policy="adaptive", draft_vocab=vocab) for name in policies}}
engines = {name: build_engine(pair, spec) for name, spec in specs.items()}
for name, make in policies.items():
    engines[name].gamma_policy = make()
    for prompt in calibration:
        engines[name].generate(prompt, greedy, specs[name], stop)
seconds = {name: [] for name in specs}
for repeat in range(args.repeats):
    total = {name: [0.0, 0] for name in specs}
    for prompt in evaluation:
        for name, engine in engines.items():
            stats = engine.generate(prompt, greedy, specs[name], stop).stats
            total[name][0] += stats.e2e_s - stats.ttft_s
            total[name][1] += stats.generated_tokens - 1
    for name in specs:
        seconds[name].append(total[name][0] / total[name][1])
    print(f"repeat {repeat}: " + "  ".join(f"{n} {1e3 * seconds[n][-1]:.3f}" for n in specs), flush=True)
for name in specs:
    ratios = [o / v for o, v in zip(seconds["off"], seconds[name])]
    print(f"{name:>9}: {statistics.median(ratios):.3f}x  (repeats {' '.join(f'{r:.3f}' for r in ratios)})")
