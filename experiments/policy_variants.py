"""Adaptive gamma policy variants against fixed gammas at batch 1, on planner_check's evaluation
prompts (the first --prompts held-out prompts per workload; the policies first run the calibration
prompts once, as there; with --swap the two halves trade places): decode ms per token (prefill
excluded) per repeat, interleaved per prompt, speedup over plain decoding = median over repeats of the
per-repeat ratio.

    OMP_NUM_THREADS=1 python experiments/policy_variants.py [--target smollm2] [--prompts 4] [--repeats 5] [--swap]
        [--priors 2,4] [--variants adaptive,start_largest,model_only]

Variants: the default policy (its batch-1 depth follows each request's runs, starting at the cost
model's gamma); ``start_largest`` (the same, each request's run started at the largest candidate);
``model_only`` (the same
without following runs: the cost model's gamma for every round);
per-request acceptance blended with more prior weight (prior_rounds 32); shared acceptance only (one
gamma for every request); the default seeded from a calibrated profile measured in this process (as
`verispec serve --profile` does); transformers' +2 / -1 heuristic (``hf``), starting at 8 and keeping
its depth across requests, and ``hf_reset``, the same rule restarted at 8 for every request; the
default policy's bookkeeping with its choice pinned to gamma 4 (``pinned4``: against ``gamma4``, what
the policy's own Python costs per round). With --hf-like, the earlier attempts (on ``model_only``) to
give the model-only policy HF's depth after fully accepted rounds: ``up1`` / ``up2`` (one or two
candidates above its choice right after one), ``hf_inside`` (HF's +2 / -1 per request, started at the
policy's choice; the policy decides only between plain decoding and speculation) and
``hf_inside_global`` (the same with HF's state kept across requests, within [1, 16]); and HF's rule on
other trajectories of the same prompts: ``hf_skip_empty`` (no +2 after a round that drafted nothing,
a request's last token) and ``hf_start5`` .. ``hf_start10`` (other initial depths).
"""
import argparse, statistics
import torch
torch.set_num_threads(1)
from verispec import profile as profiler
from verispec.adaptive import AdaptiveGamma, HFHeuristicGamma
from verispec.bench.planner_check import split_prompts
from verispec.config import SamplingParams, SpecConfig, StopRules
from verispec.loading import build_engine, load_pair, resolve_draft_vocab

ap = argparse.ArgumentParser()
ap.add_argument("--target", default="tiny", help="tiny (default) or smollm2")
ap.add_argument("--variants", default="", help="only these policies (comma-separated names), beside off and gamma 3-6")
ap.add_argument("--prompts", type=int, default=4)
ap.add_argument("--repeats", type=int, default=5)
ap.add_argument("--max-tokens", type=int, default=64)
ap.add_argument("--priors", default="", help="more variants: the default policy with these prior_rounds, e.g. 2,4")
ap.add_argument("--hf-like", action="store_true", help="more variants: up1, up2, hf_inside, hf_inside_global")
ap.add_argument("--swap", action="store_true", help="evaluate on the calibration half, calibrate on the evaluation half")
args = ap.parse_args()

pair = load_pair(args.target)
vocab = resolve_draft_vocab(pair, "auto")
evaluation, calibration = split_prompts(pair.tokenizer, args.prompts, pair.target.config.max_context - 80)
if args.swap:
    evaluation, calibration = calibration, evaluation
greedy, stop = SamplingParams(temperature=0), StopRules(max_tokens=args.max_tokens, ignore_eos=True)
data = profiler.profile(pair.target, pair.draft, max_positions=9, repeats=11, tree_shapes=(), draft_vocab=vocab)
data["calibration"] = profiler.calibrate(build_engine(pair, SpecConfig(gamma=8, draft_vocab=vocab)), calibration, 8, args.max_tokens,
                                         plain_engine=build_engine(pair, SpecConfig(method="none")))


class Pinned4(AdaptiveGamma):
    def choose(self, batch_size, request=None):
        super().choose(batch_size, request)
        return 4


class AfterFull(AdaptiveGamma):
    """At batch 1, the policy's choice moved ``steps`` candidates up right after a fully accepted round."""

    def __init__(self, steps: int, **kwargs):
        super().__init__(**kwargs)
        self.steps, self.last_full = steps, False

    def observe(self, batch_size, gamma, seconds, accepted, drafted):
        super().observe(batch_size, gamma, seconds, accepted, drafted)
        self.last_full = batch_size == 1 and bool(drafted[0]) and accepted[0] == drafted[0]

    def choose(self, batch_size, request=None):
        gamma = super().choose(batch_size, request)
        if batch_size == 1 and gamma and self.last_full and gamma in self.candidates:
            return self.candidates[min(self.candidates.index(gamma) + self.steps, len(self.candidates) - 1)]
        return gamma


class HFInside(AdaptiveGamma):
    """The policy decides plain decoding or speculation (and every batch > 1); at batch 1 the depth follows
    HF's +2 / -1, from the policy's choice at each new request, or (``keep``) carried across requests."""

    def __init__(self, keep: bool, **kwargs):
        super().__init__(**kwargs)
        self.keep, self.request, self.depth = keep, None, 8

    def choose(self, batch_size, request=None):
        gamma = super().choose(batch_size, request)
        if batch_size != 1 or not gamma:
            return gamma
        if not self.keep and request is not self.request:
            self.request, self.depth = request, gamma
        return self.depth

    def observe(self, batch_size, gamma, seconds, accepted, drafted):
        super().observe(batch_size, gamma, seconds, accepted, drafted)
        if batch_size == 1 and drafted[0]:
            self.depth = min(16, self.depth + 2) if accepted[0] == drafted[0] else max(1, self.depth - 1)


class HFReset(HFHeuristicGamma):
    """transformers' rule restarted at ``initial`` for every request."""

    def __init__(self, initial=8):
        super().__init__(initial=initial)
        self.initial, self.request = initial, None

    def choose(self, batch_size=1, request=None):
        if request is not self.request:
            self.request, self.gamma = request, self.initial
        return self.gamma


class HFSkipEmpty(HFHeuristicGamma):
    """transformers' rule without its +2 after a round that drafted nothing (a request's last token)."""

    def observe(self, batch_size, gamma, seconds, accepted, drafted):
        if any(drafted):
            super().observe(batch_size, gamma, seconds, accepted, drafted)


class StartLargest(AdaptiveGamma):
    """Batch 1's run depth started at the largest candidate for every new request (the rule before it
    started at the cost model's choice)."""

    def _run_depth(self, request, best):
        return super()._run_depth(request, self.candidates[-1])


class SharedOnly(AdaptiveGamma):
    def choose(self, batch_size, request=None):
        return super().choose(batch_size, None)


def seeded():
    policy = AdaptiveGamma(max_gamma=8)
    profiler.seed_policy(policy, data)
    return policy


policies = {"adaptive": lambda: AdaptiveGamma(max_gamma=8), "model_only": lambda: AdaptiveGamma(max_gamma=8, follow_runs=False),
            "prior32": lambda: AdaptiveGamma(max_gamma=8, prior_rounds=32),
            "shared": lambda: SharedOnly(max_gamma=8), "seeded": seeded,
            "start_largest": lambda: StartLargest(max_gamma=8),
            "hf": lambda: HFHeuristicGamma(initial=8), "hf_reset": HFReset, "pinned4": lambda: Pinned4(max_gamma=8)}
if args.hf_like:
    policies.update({"up1": lambda: AfterFull(1, max_gamma=8, follow_runs=False),
                     "up2": lambda: AfterFull(2, max_gamma=8, follow_runs=False),
                     "hf_inside": lambda: HFInside(False, max_gamma=8, follow_runs=False),
                     "hf_inside_global": lambda: HFInside(True, max_gamma=8, follow_runs=False),
                     "hf_skip_empty": lambda: HFSkipEmpty(initial=8),
                     **{f"hf_start{i}": (lambda i=i: HFHeuristicGamma(initial=i)) for i in (5, 6, 7, 9, 10)}})
for weight in (int(w) for w in args.priors.split(",") if w):
    policies[f"prior{weight}"] = lambda weight=weight: AdaptiveGamma(max_gamma=8, prior_rounds=weight)
if args.variants:
    policies = {name: policies[name] for name in args.variants.split(",")}
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
