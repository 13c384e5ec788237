"""Where the adaptive policy gains and loses against fixed gamma 3 at batch 1, prompt by prompt: the
planner check's 12 evaluation prompts (4 per workload: chat, code, math) after the policy has run the
calibration prompts once, 5 repeats, variants interleaved per prompt. Per prompt: gamma 3's decode
time per token over adaptive's (> 1: adaptive faster) and the rounds adaptive ran per drafted count.

    OMP_NUM_THREADS=1 python experiments/adaptive_per_prompt.py
"""
import collections, torch
torch.set_num_threads(1)
from verispec.adaptive import AdaptiveGamma
from verispec.bench.planner_check import split_prompts
from verispec.config import SamplingParams, SpecConfig, StopRules
from verispec.loading import build_engine, load_pair, resolve_draft_vocab

pair = load_pair("tiny")
vocab = resolve_draft_vocab(pair, "auto")
evaluation, calibration = split_prompts(pair.tokenizer, 4, pair.target.config.max_context - 80)
greedy, stop = SamplingParams(temperature=0), StopRules(max_tokens=64, ignore_eos=True)
specs = {"off": SpecConfig(method="none"), "gamma3": SpecConfig(gamma=3, draft_vocab=vocab),
         "adaptive": SpecConfig(gamma=8, gamma_policy="adaptive", draft_vocab=vocab)}
engines = {name: build_engine(pair, spec) for name, spec in specs.items()}
engines["adaptive"].gamma_policy = AdaptiveGamma(max_gamma=8)
for prompt in calibration:
    engines["adaptive"].generate(prompt, greedy, specs["adaptive"], stop)
for repeat in range(5):
    per_token = collections.defaultdict(list)
    for index, prompt in enumerate(evaluation):
        for name, engine in engines.items():
            stats = engine.generate(prompt, greedy, specs[name], stop).stats
            per_token[name].append((stats.e2e_s - stats.ttft_s) / (stats.generated_tokens - 1))
            if name == "adaptive":
                rounds = collections.Counter(r.drafted for r in stats.rounds)
        print(f"repeat {repeat} prompt {index:2d}: gamma 3 / adaptive {per_token['gamma3'][-1] / per_token['adaptive'][-1]:.3f}"
              f"  adaptive rounds by drafted {' '.join(f'{g}:{n}' for g, n in sorted(rounds.items()))}")
    print(f"repeat {repeat} all: gamma 3 / adaptive {sum(per_token['gamma3']) / sum(per_token['adaptive']):.3f}", flush=True)
