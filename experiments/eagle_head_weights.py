"""SmolLM2's EAGLE head with its own weights as saved (bf16, ``--draft-weights native``), rounded to GGUF
Q8_0 blocks (``q8_0``, the default) and as int8 rows (``int8``), side by side in one process: plain
decoding and the head's chains (fixed gammas, optionally behind --lookup), every variant over the same
held-out prompts once per repeat, variants interleaved; tokens/s medians over repeats, tokens per round,
ms per draft step, and whether each variant's greedy output equals plain decoding's.

    OMP_NUM_THREADS=1 python experiments/eagle_head_weights.py --prompts 4 --tokens 64 --repeats 4 [--lookup 3]
"""

import argparse
import statistics
import time

import torch

from verispec import kernels
from verispec.config import SamplingParams, SpecConfig, StopRules
from verispec.demo import demo_prompts
from verispec.loading import build_engine, eos_ids, load_pair
from verispec.models.eagle import load_eagle


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=4, help="held-out prompts per workload (code, chat, math)")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--gammas", default="1,2")
    parser.add_argument("--lookup", type=int, default=0, help="lookup first (--lookup N) before the head's drafts")
    parser.add_argument("--weights", default="native,q8_0,int8")
    args = parser.parse_args()
    torch.set_num_threads(1)
    pair = load_pair("smollm2", need_eagle=True)
    heads = {w: load_eagle(pair.eagle_dir, pair.target, weights=w) for w in args.weights.split(",")}
    prompts = demo_prompts(args.prompts, "smollm2")
    jobs = [pair.tokenizer.encode(p, add_special_tokens=False) for w in ("code", "chat", "math") for p in prompts[w]]
    stop = StopRules(max_tokens=args.tokens, eos_ids=tuple(eos_ids(pair.tokenizer, pair.target)))
    variants = {"off": (next(iter(heads)), SpecConfig(method="none"))}
    for gamma in (int(g) for g in args.gammas.split(",")):
        for weights in heads:
            variants[f"gamma {gamma}, {weights}"] = (weights, SpecConfig(
                method="chain", gamma=gamma, drafter="eagle", gamma_policy="fixed", lookup=args.lookup))
    engines = {}
    for name, (weights, spec) in variants.items():
        pair.eagle = heads[weights]
        engines[name] = (build_engine(pair, spec), spec)
    rates = {name: [] for name in engines}
    per_round = {name: [] for name in engines}
    step_ms = {name: [] for name in engines}
    outputs = {}
    for _ in range(args.repeats):
        for name, (engine, spec) in engines.items():
            began, tokens, rounds = time.perf_counter(), 0, 0
            for index, ids in enumerate(jobs):
                result = engine.generate(ids, SamplingParams(temperature=0), spec, stop)
                tokens += len(result.tokens)
                rounds += result.stats.summary().get("rounds", 0) or 0
                outputs[(name, index)] = result.tokens
                step_ms[name] += [1e3 * r.draft_s / r.drafted for r in result.stats.rounds[1:] if r.drafted]
            rates[name].append(tokens / (time.perf_counter() - began))
            per_round[name].append(tokens / max(rounds, 1))
    base = statistics.median(rates["off"])
    print(f"{len(jobs)} prompts x {args.tokens} tokens, {args.repeats} repeats, 1 thread, lookup {args.lookup}; "
          f"kernel {kernels.paths()}")
    for name in engines:
        same = all(outputs[(name, i)] == outputs[("off", i)] for i in range(len(jobs)))
        rate = statistics.median(rates[name])
        step = f"{statistics.median(step_ms[name]):.2f}" if step_ms[name] else "-"
        print(f"{name:16s} {rate:7.1f} tok/s  {rate / base:.3f}x plain  tokens/round {statistics.median(per_round[name]):.2f}"
              f"  ms/draft {step}  identical: {'yes' if same else 'NO'}")


if __name__ == "__main__":
    main()
