"""Chain acceptance (gamma 4) of the shipped SmolLM2 draft on held-out prompts, greedy and at temperature 1,
with 95% bootstrap intervals over prompts.

    OMP_NUM_THREADS=2 python experiments/smollm2_acceptance.py --prompts 64 --out docs/results/raw-acc.json

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
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    pair = load_pair("smollm2")
    spec = SpecConfig(method="chain", gamma=args.gamma, draft_vocab=resolve_draft_vocab(pair, "auto"))
    prompts = heldout_bench_prompts(pair.tokenizer, 2048, args.prompts, args.max_tokens)
    engine = build_engine(pair, spec)
    record = {"gamma": args.gamma, "max_tokens": args.max_tokens, "draft_vocab": spec.draft_vocab,
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
