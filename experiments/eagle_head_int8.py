"""SmolLM2's EAGLE head with its own weights (bf16) against the same head quantized to int8 for the kernel
(``kernels.quantize``, as the draft model ships), side by side in one process: plain decoding and the
head's chains at fixed gamma 1 and 2, every variant over the same held-out prompts once per repeat,
variants interleaved; tokens/s medians over repeats, tokens per round, and whether each variant's greedy
output equals plain decoding's.

    OMP_NUM_THREADS=1 python experiments/eagle_head_int8.py --prompts 4 --tokens 64 --repeats 4
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
    args = parser.parse_args()
    torch.set_num_threads(1)
    pair = load_pair("smollm2", need_eagle=True)
    heads = {"bf16": pair.eagle, "int8": load_eagle(pair.eagle_dir, pair.target)}
    kernels.quantize(heads["int8"].body)
    kernels.quantize(heads["int8"].fc)
    prompts = demo_prompts(args.prompts, "smollm2")
    jobs = [pair.tokenizer.encode(p, add_special_tokens=False) for w in ("code", "chat", "math") for p in prompts[w]]
    stop = StopRules(max_tokens=args.tokens, eos_ids=tuple(eos_ids(pair.tokenizer, pair.target)))
    variants = {"off": ("bf16", SpecConfig(method="none"))}
    for gamma in (1, 2):
        for weights in heads:
            variants[f"gamma {gamma}, {weights}"] = (
                weights, SpecConfig(method="chain", gamma=gamma, drafter="eagle", gamma_policy="fixed"))
    engines = {}
    for name, (weights, spec) in variants.items():
        pair.eagle = heads[weights]
        engines[name] = (build_engine(pair, spec), spec)
    rates = {name: [] for name in engines}
    per_round = {name: [] for name in engines}
    outputs = {}
    for _ in range(args.repeats):
        for name, (engine, spec) in engines.items():
            began, tokens, rounds = time.perf_counter(), 0, 0
            for index, ids in enumerate(jobs):
                result = engine.generate(ids, SamplingParams(temperature=0), spec, stop)
                tokens += len(result.tokens)
                rounds += result.stats.summary().get("rounds", 0) or 0
                outputs[(name, index)] = result.tokens
            rates[name].append(tokens / (time.perf_counter() - began))
            per_round[name].append(tokens / max(rounds, 1))
    base = statistics.median(rates["off"])
    print(f"{len(jobs)} prompts x {args.tokens} tokens, {args.repeats} repeats, 1 thread; kernel {kernels.paths()}")
    for name in engines:
        same = all(outputs[(name, i)] == outputs[("off", i)] for i in range(len(jobs)))
        rate = statistics.median(rates[name])
        print(f"{name:14s} {rate:7.1f} tok/s  {rate / base:.3f}x plain  tokens/round {statistics.median(per_round[name]):.2f}"
              f"  identical: {'yes' if same else 'NO'}")


if __name__ == "__main__":
    main()
