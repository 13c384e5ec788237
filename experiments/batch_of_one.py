"""A single request in BatchEngine (a batch of one) against SpecEngine: the same held-out prompts, the same
method, interleaved per prompt and repeat; tokens/s medians and whether the tokens are identical. The
question behind it: what would `generate` lose by running through the batched engine?

    OMP_NUM_THREADS=1 python experiments/batch_of_one.py --target tiny --methods chain,tree,ngram,self,eagle
    OMP_NUM_THREADS=1 python experiments/batch_of_one.py --target tiny --backend hf --methods off,chain,tree,ngram

With ``--backend hf`` the models run through transformers, whose caches hold one sequence: the batched
engine wraps them in ``RowLoop`` (a pass per row), so this measures what that wrapper costs.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from verispec.batch import BatchEngine, BatchRequest
from verispec.bench.planner_check import split_prompts
from verispec.config import SamplingParams, SpecConfig, StopRules
from verispec.loading import build_engine, load_pair

SPECS = {"chain": SpecConfig(gamma=5), "tree": SpecConfig(method="tree", tree="s3_k2_d6"),
         "ngram": SpecConfig(gamma=5, drafter="ngram"), "self": SpecConfig(gamma=3, drafter="early_exit"),
         "eagle": SpecConfig(gamma=5, drafter="eagle"), "off": SpecConfig(method="none")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="tiny")
    parser.add_argument("--backend", default="auto", choices=["auto", "native", "hf"])
    parser.add_argument("--methods", default="off,chain,tree,ngram,self,eagle")
    parser.add_argument("--prompts", type=int, default=2, help="held-out prompts per workload (code, chat, math)")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    methods = args.methods.split(",")
    pair = load_pair(args.target, need_eagle="eagle" in methods, backend=args.backend)
    prompts, _ = split_prompts(pair.tokenizer, args.prompts, 512)
    greedy, stop = SamplingParams(temperature=0), StopRules(max_tokens=args.max_tokens, ignore_eos=True)
    print(f"{'method':8} {'SpecEngine tok/s':>17} {'batch of one':>13} {'ratio':>6}  identical")
    for name in methods:
        spec = SPECS[name]
        single = build_engine(pair, spec)
        batched = BatchEngine(pair.target, pair.draft, spec, max_batch=1, eagle=pair.eagle)
        rates: dict[str, list[float]] = {"single": [], "batch": []}
        identical = True
        for repeat in range(args.repeats + 1):  # the first pass warms both engines up
            for prompt in prompts:
                began = time.perf_counter()
                alone = single.generate(prompt, greedy, spec, stop).tokens
                single_s = time.perf_counter() - began
                began = time.perf_counter()
                tokens = [t for event in batched.add(BatchRequest("r", prompt, greedy, stop)) for t in event.tokens]
                while batched.active:
                    tokens += [t for event in batched.step() for t in event.tokens]
                batch_s = time.perf_counter() - began
                identical &= tokens == alone
                if repeat:
                    rates["single"].append(len(alone) / single_s)
                    rates["batch"].append(len(tokens) / batch_s)
        one, many = statistics.median(rates["single"]), statistics.median(rates["batch"])
        print(f"{name:8} {one:17.1f} {many:13.1f} {many / one:6.2f}  {identical}")


if __name__ == "__main__":
    main()
