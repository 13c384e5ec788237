"""The embedded draft with its checkpoint's bf16 weights against int8 (``loading.quantize_draft``), side by
side in one process:

1. a draft step (one token, context 200, 2048-id head) in a tight loop and right after 32 MB of other
   memory traffic (what a target pass does to the caches between draft steps), ms, medians;
2. greedy match rate per workload: how often the draft's greedy choice is the target's next greedy
   token (teacher-forced along the target's greedy continuation of each held-out prompt, 96 tokens);
3. greedy decoding end to end: plain, and chains at gamma 2..6 with each draft, every variant run once
   per prompt in turn (interleaved), ``--repeats`` times; decode tokens/s (prefill excluded) and the
   median over repeats of each chain's speedup over plain in the same repeat.

    OMP_NUM_THREADS=1 python experiments/draft_int8.py --repeats 5
    OMP_NUM_THREADS=1 python experiments/draft_int8.py --repeats 5 --versus OTHER_DRAFT_DIR  # two drafts, int8
"""
import argparse
import json
import statistics
import time

import torch

from verispec.config import SamplingParams, SpecConfig, StopRules
from verispec.demo import PROMPTS_FILE
from verispec.loading import EMBEDDED_DRAFT_VOCAB, build_engine, load_pair

parser = argparse.ArgumentParser()
parser.add_argument("--repeats", type=int, default=5)
parser.add_argument("--prompts", type=int, default=3, help="held-out prompts per workload")
parser.add_argument("--max-tokens", type=int, default=64)
parser.add_argument("--gammas", default="2,3,4,5,6")
parser.add_argument("--versus", metavar="DRAFT_DIR",
                    help="compare the shipped draft with this one, both int8 (instead of bf16 vs int8)")
args = parser.parse_args()
torch.set_num_threads(1)
GREEDY = SamplingParams(temperature=0)

if args.versus:
    pairs = {"shipped": load_pair("tiny", draft_weights="int8"), "versus": load_pair("tiny", args.versus, draft_weights="int8")}
else:
    pairs = {"native": load_pair("tiny", draft_weights="native"), "int8": load_pair("tiny", draft_weights="int8")}
first = next(iter(pairs.values()))  # plain decoding runs on the first pair's target
tokenizer = first.tokenizer
texts = json.loads(PROMPTS_FILE.read_text())


def step_ms(model) -> tuple[float, float]:
    cache = model.new_cache(1, 400)
    flush = torch.randn(8_000_000)
    with torch.inference_mode():
        model.forward(torch.tensor([list(range(5, 205))]), cache, last_only=True)
        cache.commit(0, 200)
        token = torch.tensor([[7]])

        def step():
            model.forward(token, cache, last_only=True, vocab_limit=EMBEDDED_DRAFT_VOCAB)
        for _ in range(50):
            step()
        hot, cold = [], []
        for _ in range(15):
            began = time.perf_counter()
            for _ in range(100):
                step()
            hot.append((time.perf_counter() - began) * 10)
            flush.mul_(1.0000001)
            began = time.perf_counter()
            step()
            cold.append((time.perf_counter() - began) * 1e3)
    return statistics.median(hot), statistics.median(cold)


for name, pair in pairs.items():
    hot, cold = step_ms(pair.draft)
    print(f"draft step, {name:6s}: {hot:.3f} ms in a loop, {cold:.3f} ms after 32 MB of other traffic")

plain = build_engine(first, SpecConfig(method="none"))
continuations = []
for workload, items in texts.items():
    for text in items:
        ids = tokenizer.encode(text, add_special_tokens=False)[-200:]
        out = plain.generate(ids, GREEDY, SpecConfig(method="none"), StopRules(max_tokens=96, ignore_eos=True))
        continuations.append((workload, ids, out.tokens))
for name, pair in pairs.items():
    rates = {}
    for workload, ids, generated in continuations:
        tokens = ids + generated
        cache = pair.draft.new_cache(1, len(tokens))
        with torch.inference_mode():
            logits = pair.draft.forward(torch.tensor([tokens]), cache, vocab_limit=EMBEDDED_DRAFT_VOCAB)[0]
        guesses = logits[len(ids):len(tokens) - 1].argmax(-1).tolist()
        rates.setdefault(workload, []).extend(g == t for g, t in zip(guesses, generated[1:]))
    print(f"greedy match rate, {name:6s}: " + ", ".join(f"{w} {sum(v) / len(v):.4f}" for w, v in rates.items()))

gammas = [int(g) for g in args.gammas.split(",")]
configs = {"off": (first, SpecConfig(method="none"))}
for g in gammas:
    for name, pair in pairs.items():
        configs[f"{name} g{g}"] = (pair, SpecConfig(method="chain", gamma=g, draft_vocab=EMBEDDED_DRAFT_VOCAB))
engines = {name: build_engine(pair, spec) for name, (pair, spec) in configs.items()}
prompts = [tokenizer.encode(t, add_special_tokens=False)[-200:] for items in texts.values() for t in items[:args.prompts]]
stop = StopRules(max_tokens=args.max_tokens, ignore_eos=True)
for name, engine in engines.items():
    engine.generate(prompts[0], GREEDY, configs[name][1], StopRules(max_tokens=8, ignore_eos=True))
rates = {name: [] for name in configs}
committed = {name: [] for name in configs}
for _ in range(args.repeats):
    seconds = dict.fromkeys(configs, 0.0)
    tokens = dict.fromkeys(configs, 0)
    for prompt in prompts:
        for name, engine in engines.items():
            stats = engine.generate(prompt, GREEDY, configs[name][1], stop).stats
            seconds[name] += stats.e2e_s - stats.ttft_s
            tokens[name] += stats.generated_tokens - 1
            committed[name].append(stats.summary()["committed_per_round"])
    for name in configs:
        rates[name].append(tokens[name] / seconds[name])
print(f"\n{'variant':12s} {'tok/s':>8s} {'speedup':>8s} {'committed/round':>16s}")
for name in configs:
    speedup = statistics.median(r / o for r, o in zip(rates[name], rates["off"]))
    print(f"{name:12s} {statistics.median(rates[name]):8.1f} {speedup:7.3f}x {statistics.fmean(committed[name]):16.2f}")
