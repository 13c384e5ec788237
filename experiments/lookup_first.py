"""Lookup first (``--lookup N``: a round whose context repeats its last N+ tokens drafts the repeat, others
ask the drafter) against the drafter alone and against n-gram lookup alone, on SmolLM2 with its EAGLE head
and its draft model: one process, every variant over the same held-out prompts once per repeat, variants
interleaved (rotated per repeat); tokens/s medians over repeats per workload and over all, tokens per
round, the share of rounds drafted by lookup, and whether each variant's greedy output equals plain
decoding's.

    OMP_NUM_THREADS=1 python experiments/lookup_first.py --prompts 4 --tokens 128 --repeats 3
        [--variants off,ngram:4,eagle:2,eagle+3:2,...]

A variant is off or drafter[+N[/L]]:G[a]: drafter eagle, model or ngram; +N lookup first with repeats of
N+ tokens, /L letting a lookup draft up to L (--lookup-drafts L: the drafter keeps G, lookups draft up to L);
G drafts per round (with a: the adaptive policy, at most G). With --eagle-b DIR, a variant ending in @B uses
that head instead of the shipped one (e.g. eagle+3:2,eagle+3:2@B: a retrained head against the shipped one).
"""

import argparse
import statistics
import time
from dataclasses import replace

import torch

from verispec import kernels
from verispec.config import SamplingParams, SpecConfig, StopRules
from verispec.demo import demo_prompts
from verispec.loading import build_engine, eos_ids, load_pair
from verispec.models.eagle import load_eagle

WORKLOADS = ("code", "chat", "math")
DEFAULT_VARIANTS = "off,ngram:4,eagle:2,eagle:4,eagle+2:4,eagle+3:2,eagle+3:4,eagle+4:4,model:1,model+3:2"


def spec_for(variant: str) -> SpecConfig:
    variant = variant.removesuffix("@B")
    if variant == "off":
        return SpecConfig(method="none")
    head, _, gamma = variant.partition(":")
    drafter, _, lookup = head.partition("+")
    lookup, _, lookup_drafts = lookup.partition("/")
    return SpecConfig(method="chain", gamma=int(gamma.rstrip("a")), drafter=drafter, lookup=int(lookup or 0),
                      lookup_drafts=int(lookup_drafts or 0),
                      gamma_policy="adaptive" if gamma.endswith("a") else "fixed", draft_vocab=None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=4, help="held-out prompts per workload (code, chat, math)")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--variants", default=DEFAULT_VARIANTS)
    parser.add_argument("--eagle-b", default=None, help="a second EAGLE head directory, used by variants ending in @B")
    args = parser.parse_args()
    torch.set_num_threads(1)
    pair = load_pair("smollm2", need_eagle=True)
    prompts = demo_prompts(args.prompts, "smollm2")
    jobs = [(w, pair.tokenizer.encode(p, add_special_tokens=False)) for w in WORKLOADS for p in prompts[w]]
    stop = StopRules(max_tokens=args.tokens, eos_ids=tuple(eos_ids(pair.tokenizer, pair.target)))
    names = args.variants.split(",")
    pair_b = None if args.eagle_b is None else replace(pair, eagle=load_eagle(args.eagle_b, pair.target),
                                                         eagle_dir=args.eagle_b)
    engines = {name: (build_engine(pair_b if name.endswith("@B") else pair, spec_for(name)), spec_for(name))
               for name in names}
    seconds = {(name, w): [] for name in names for w in WORKLOADS + ("all",)}
    tokens = {(name, w): 0 for name in names for w in WORKLOADS}
    rounds = {(name, w): 0 for name in names for w in WORKLOADS}
    lookups = {name: 0 for name in names}
    outputs = {}
    for repeat in range(args.repeats):
        order = names[repeat % len(names):] + names[:repeat % len(names)]
        for name in order:
            engine, spec = engines[name]
            spent = dict.fromkeys(WORKLOADS, 0.0)
            for index, (workload, ids) in enumerate(jobs):
                began = time.perf_counter()
                result = engine.generate(ids, SamplingParams(temperature=0), spec, stop)
                spent[workload] += time.perf_counter() - began
                outputs[(name, index)] = result.tokens
                if repeat == 0:
                    tokens[(name, workload)] += len(result.tokens)
                    rounds[(name, workload)] += len(result.stats.rounds)
                    lookups[name] += getattr(engine.drafter, "lookups", 0)
            for workload in WORKLOADS:
                seconds[(name, workload)].append(spent[workload])
            seconds[(name, "all")].append(sum(spent.values()))
    print(f"{len(jobs)} held-out prompts ({args.prompts} per workload) x {args.tokens} greedy tokens at most, "
          f"{args.repeats} repeats, 1 thread; kernel paths {kernels.paths()}")
    print(f"{'variant':14s} " + " ".join(f"{w:>22s}" for w in WORKLOADS + ("all",)) + "  lookup rounds  identical")
    for name in names:
        cells = []
        for workload in WORKLOADS + ("all",):
            done = sum(tokens[(name, w)] for w in (WORKLOADS if workload == "all" else (workload,)))
            made = sum(rounds[(name, w)] for w in (WORKLOADS if workload == "all" else (workload,)))
            ratios = [o / s for s, o in zip(seconds[(name, workload)], seconds[("off", workload)])] \
                if "off" in names else [float("nan")]
            rate = done / statistics.median(seconds[(name, workload)])
            cells.append(f"{rate:6.1f} {statistics.median(ratios):.2f}x {done / max(made, 1):4.2f}/r")
        all_rounds = sum(rounds[(name, w)] for w in WORKLOADS)
        same = all(outputs[(name, i)] == outputs[(names[0], i)] for i in range(len(jobs)))
        print(f"{name:14s} " + " ".join(f"{c:>22s}" for c in cells)
              + f"  {lookups[name] / max(all_rounds, 1):13.2f}  {'yes' if same else 'NO'}")
    print("cells: tokens/s, ratio to off (median of per-repeat ratios), committed tokens per round; "
          "identical: every output equals the first variant's")


if __name__ == "__main__":
    main()
