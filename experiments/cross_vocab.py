"""A draft with another tokenizer (token-level intersection) against the target's own draft, on SmolLM2:
chain acceptance, committed tokens per round and decoding speed relative to plain decoding.

    OMP_NUM_THREADS=1 python experiments/cross_vocab.py --prompts 8 --max-tokens 64 --out docs/results/x.json

Drafts compared: ``same`` (SmolLM2's shipped draft, its tokenizer) and ``cross`` (the tiny pair's draft
with its own 8,192-token vocabulary, drafting over the tokens both share; ``--cross-draft DIR`` for
another). Held-out chat, code and math prompts, ``--max-tokens`` tokens each with EOS ignored, greedy and
t=1. Speed: each prompt decoded plain, with ``same`` and with ``cross`` in turn (so machine noise hits
all alike), ``--repeats`` times; tok/s is the median over repeats of total tokens over total seconds.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from verispec import kernels
from verispec.config import SamplingParams, SpecConfig, StopRules
from verispec.loading import (DEFAULT_DRAFT, build_engine, load_model, load_pair, load_tokenizer,
                              quantize_draft, resolve_draft_vocab)
from verispec.train.card import heldout_bench_prompts
from verispec.vocab import VocabBridge


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=8, help="prompts per workload")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cross-draft", default=str(DEFAULT_DRAFT), help="a draft with its own tokenizer")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    pair = load_pair("smollm2")
    draft = load_model(args.cross_draft)
    quantize_draft(draft)
    bridge = VocabBridge.build(pair.tokenizer, load_tokenizer(args.cross_draft), pair.target.config.vocab_size,
                               draft.config.vocab_size)
    crossed = dataclasses.replace(pair, draft=draft, draft_dir=Path(args.cross_draft), bridge=bridge)
    specs = {"same": SpecConfig(gamma=args.gamma, draft_vocab=resolve_draft_vocab(pair, "auto")),
             "cross": SpecConfig(gamma=args.gamma, draft_vocab=resolve_draft_vocab(crossed, "auto"))}
    engines = {"plain": build_engine(pair, SpecConfig(method="none")), "same": build_engine(pair, specs["same"]),
               "cross": build_engine(crossed, specs["cross"])}
    specs["plain"] = SpecConfig(method="none")
    prompts = [ids for items in heldout_bench_prompts(pair.tokenizer, 2048, args.prompts, args.max_tokens).values()
               for ids in items]
    stop = StopRules(max_tokens=args.max_tokens, ignore_eos=True)
    record = {"cpu": platform.processor() or platform.machine(), "kernel": kernels.status(), "threads": 1,
              "target": "smollm2", "gamma": args.gamma, "max_tokens": args.max_tokens, "prompts": len(prompts),
              "shared_tokens": bridge.shared, "cross_draft": str(args.cross_draft), "acceptance": {}, "speed": {}}

    for setting, sampling in (("greedy", SamplingParams(temperature=0)), ("t1", SamplingParams(temperature=1.0))):
        record["acceptance"][setting] = {}
        for name in ("same", "cross"):
            drafted = accepted = committed = rounds = 0
            for seed, ids in enumerate(tqdm(prompts, desc=f"{setting} {name}", file=sys.stderr, leave=False)):
                stats = engines[name].generate(ids, sampling, specs[name], stop, seed=seed).stats
                drafted, accepted = drafted + stats.drafted, accepted + stats.accepted
                committed, rounds = committed + sum(r.committed for r in stats.rounds), rounds + len(stats.rounds)
            record["acceptance"][setting][name] = {"acceptance_rate": accepted / max(drafted, 1),
                                                   "committed_per_round": committed / max(rounds, 1)}

    greedy = SamplingParams(temperature=0)
    seconds = {name: [] for name in engines}
    outputs = {}
    for _ in tqdm(range(args.repeats), desc="speed", file=sys.stderr, leave=False):
        totals = dict.fromkeys(engines, 0.0)
        for ids in prompts:
            for name, engine in engines.items():
                began = time.perf_counter()
                outputs[name, tuple(ids)] = engine.generate(ids, greedy, specs[name], stop).tokens
                totals[name] += time.perf_counter() - began
        for name in engines:
            seconds[name].append(totals[name])
    identical = all(outputs["same", tuple(ids)] == outputs["plain", tuple(ids)] == outputs["cross", tuple(ids)]
                    for ids in prompts)
    tokens = len(prompts) * args.max_tokens
    for name in engines:
        record["speed"][name] = {"tok_s": tokens / statistics.median(seconds[name]),
                                 "vs_plain": statistics.median(p / s for p, s in zip(seconds["plain"], seconds[name]))}
    record["greedy_outputs_identical"] = identical
    print(json.dumps(record, indent=1))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
