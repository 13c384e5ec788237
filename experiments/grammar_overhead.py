"""What a grammar costs per token under speculation: decode the same JSON-asking chat prompts with and
without a JSON schema, plain and speculative, and time the matcher's own work (masks, staging,
rollback) inside the constrained runs.

    python experiments/grammar_overhead.py [--target smollm2] [--methods none,chain,eagle] [--repeats 3]

Figures per method: decoding ms per token after the first (prefill excluded, since the outputs differ
in length), unconstrained and constrained (medians over repeats of the whole prompt set; the texts
differ, so acceptance differs too), and the matcher's ms per token, which is the overhead itself.
Greedy, one thread.
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import statistics
import time
from dataclasses import replace

import torch

PROMPTS = ["Describe a fictional person as JSON: name, age, city and two hobbies.",
           "Give me a JSON record of a book: title, author, year, genres.",
           "Return JSON for a weather report: city, temperature, conditions, wind.",
           "Make up a product as JSON with a name, a price, tags and whether it is in stock."]
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "city": {"type": "string", "maxLength": 40}, "tags": {"type": "array", "items": {"type": "string", "maxLength": 20},
                                                           "maxItems": 4},
    "active": {"type": "boolean"}}, "required": ["name", "age", "city", "tags", "active"],
    "additionalProperties": False}
METHODS = {"none": dict(method="none"), "chain": dict(gamma=4), "eagle": dict(drafter="eagle", gamma=3),
           "ngram": dict(drafter="ngram", gamma=4)}


class MatcherClock:
    """Seconds spent inside the Constraint's methods (outermost calls only)."""

    def __init__(self):
        from verispec.grammar import Constraint

        self.seconds, self.depth = 0.0, 0
        for name in ("mask", "stage", "round_masks", "unstage", "advance", "tree_masks", "mask_after", "reset"):
            setattr(Constraint, name, self._timed(getattr(Constraint, name)))

    def _timed(self, method):
        @functools.wraps(method)
        def wrapper(*args, **kwargs):
            self.depth += 1
            began = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.depth -= 1
                if self.depth == 0:
                    self.seconds += time.perf_counter() - began
        return wrapper


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2")
    parser.add_argument("--methods", default="none,chain,eagle")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from verispec.config import SamplingParams, SpecConfig, StopRules
    from verispec.grammar import GrammarCompiler, GrammarSpec
    from verispec.loading import build_engine, encode_prompt, eos_ids, load_pair

    torch.set_num_threads(1)
    methods = args.methods.split(",")
    pair = load_pair(args.target, need_eagle="eagle" in methods)
    eos = eos_ids(pair.tokenizer, pair.target)
    compiler = GrammarCompiler(pair.tokenizer, pair.target.config.vocab_size, eos)
    clock = MatcherClock()
    prompts = [encode_prompt(pair.tokenizer, text, chat=True) for text in PROMPTS]
    stop = StopRules(max_tokens=args.max_tokens, eos_ids=tuple(eos))
    rows = []
    for method in methods:
        spec = SpecConfig(**METHODS[method])
        engine = build_engine(pair, spec)
        figures = {}
        for constrained in (False, True):
            per_token, matcher_per_token, rounds = [], [], []
            for _ in range(args.repeats):
                clock.seconds, tokens, seconds, committed = 0.0, 0, 0.0, []
                for prompt in prompts:
                    sampling = SamplingParams(temperature=0)
                    if constrained:
                        sampling = replace(sampling, guide=compiler.constraint(GrammarSpec.json_schema(SCHEMA)))
                    result = engine.generate(prompt, sampling, spec, stop)
                    seconds += result.stats.e2e_s - result.stats.prefill_s  # decoding only: outputs differ in length
                    tokens += len(result.tokens) - 1  # the first comes from the prefill
                    committed.append(result.stats.summary().get("committed_per_round") or 1.0)
                per_token.append(1e3 * seconds / tokens)
                matcher_per_token.append(1e3 * clock.seconds / tokens)
                rounds.append(statistics.mean(committed))
            figures["constrained" if constrained else "free"] = {
                "ms_per_token": round(statistics.median(per_token), 3),
                "matcher_ms_per_token": round(statistics.median(matcher_per_token), 4),
                "committed_per_round": round(statistics.median(rounds), 3), "tokens": tokens}
        free, bound = figures["free"], figures["constrained"]
        rows.append({"method": method, **{f"{k}_{key}": v for k, f in figures.items() for key, v in f.items()},
                     "matcher_share": round(bound["matcher_ms_per_token"] / bound["ms_per_token"], 4),
                     "constrained_vs_free": round(bound["ms_per_token"] / free["ms_per_token"], 3)})
        print(json.dumps(rows[-1]), flush=True)
    print(json.dumps({"cpu": platform.processor() or platform.machine(), "target": args.target,
                      "max_tokens": args.max_tokens, "repeats": args.repeats, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
