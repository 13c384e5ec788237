"""How much one gamma for all requests leaves on the table: fixed gammas 1..8, HF's +2 / -1 and the
adaptive policy on each of planner_check's 12 evaluation prompts (64 greedy tokens, medians of 3
repeats, interleaved per prompt; the policies first run the calibration prompts), and the speedup of
an oracle that picks each prompt's best fixed gamma.

    OMP_NUM_THREADS=1 python experiments/per_prompt_best.py
"""
import statistics
import torch
torch.set_num_threads(1)
from verispec.adaptive import HFHeuristicGamma
from verispec.bench.planner_check import split_prompts
from verispec.config import SamplingParams, SpecConfig, StopRules
from verispec.loading import build_engine, load_pair, resolve_draft_vocab

pair = load_pair("tiny")
vocab = resolve_draft_vocab(pair, "auto")
evaluation, calibration = split_prompts(pair.tokenizer, 4, pair.target.config.max_context - 80)
greedy, stop = SamplingParams(temperature=0), StopRules(max_tokens=64, ignore_eos=True)
specs = {"off": SpecConfig(method="none"), **{f"g{g}": SpecConfig(gamma=g, draft_vocab=vocab) for g in (1, 2, 3, 4, 5, 6, 8)},
         "hf": SpecConfig(gamma=8, gamma_policy="hf", draft_vocab=vocab),
         "adaptive": SpecConfig(gamma=8, gamma_policy="adaptive", draft_vocab=vocab)}
engines = {name: build_engine(pair, spec) for name, spec in specs.items()}
engines["hf"].gamma_policy = HFHeuristicGamma(initial=8)
for name in ("hf", "adaptive"):
    for prompt in calibration:
        engines[name].generate(prompt, greedy, specs[name], stop)
times = {name: [[0.0] * len(evaluation) for _ in range(3)] for name in specs}  # ms per decoded token
for repeat in range(3):
    for index, prompt in enumerate(evaluation):
        for name, engine in engines.items():
            stats = engine.generate(prompt, greedy, specs[name], stop).stats
            times[name][repeat][index] = (stats.e2e_s - stats.ttft_s) / (stats.generated_tokens - 1)
median = {name: [statistics.median(times[name][r][i] for r in range(3)) for i in range(len(evaluation))]
          for name in specs}
for index in range(len(evaluation)):
    print(f"prompt {index:2d}: " + " ".join(f"{n} {median['off'][index] / median[n][index]:.2f}x" for n in specs if n != "off"))
fixed = [name for name in specs if name.startswith("g")]
oracle = sum(min(median[name][i] for name in fixed) for i in range(len(evaluation)))
for name in specs:
    print(f"{name:>9}: {sum(median['off']) / sum(median[name]):.3f}x over the 12 prompts")
print(f"   oracle: {sum(median['off']) / oracle:.3f}x (each prompt's best fixed gamma)")
