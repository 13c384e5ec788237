"""Chain acceptance (gamma 4) of the shipped SmolLM2 draft model (or, with --method eagle, its EAGLE head)
on held-out prompts, greedy and at temperature 1, with 95% bootstrap intervals over prompts.

    OMP_NUM_THREADS=2 python experiments/smollm2_acceptance.py --prompts 64 --out docs/results/raw-acc.json
    OMP_NUM_THREADS=2 python experiments/smollm2_acceptance.py --method eagle --prompts 64

The benchmark's held-out prompt sets (ShareGPT conversations through SmolLM2's chat template, standard-
library functions, synthetic arithmetic), ``--max-tokens`` tokens each, EOS ignored so every prompt
contributes the same number of positions.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tqdm import tqdm

from verispec.config import SamplingParams, SpecConfig
from verispec.loading import build_engine, load_pair, resolve_draft_vocab
from verispec.train.card import acceptance_by_workload, heldout_bench_prompts


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=64, help="prompts per workload")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--method", choices=("model", "eagle"), default="model")
    parser.add_argument("--target", default="smollm2")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    eagle = args.method == "eagle"
    pair = load_pair(args.target, need_draft=not eagle, need_eagle=eagle)
    spec = SpecConfig(method="chain", gamma=args.gamma, drafter="eagle") if eagle else \
        SpecConfig(method="chain", gamma=args.gamma, draft_vocab=resolve_draft_vocab(pair, "auto"))
    prompts = heldout_bench_prompts(pair.tokenizer, 2048, args.prompts, args.max_tokens)
    engine = build_engine(pair, spec)
    record = {"target": args.target, "method": args.method, "gamma": args.gamma, "max_tokens": args.max_tokens,
              "draft_vocab": pair.eagle.draft_vocab if eagle else spec.draft_vocab,
              "prompts": {w: len(p) for w, p in prompts.items()}, "results": {}}
    for name, sampling in (("greedy", SamplingParams(temperature=0)), ("t1", SamplingParams(temperature=1.0))):
        with tqdm(total=sum(len(p) for p in prompts.values()), desc=name, file=sys.stderr) as bar:
            record["results"][name] = acceptance_by_workload(engine, prompts, spec, sampling, args.max_tokens, bar)
    print(json.dumps(record, indent=1))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
