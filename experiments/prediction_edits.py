"""Predicted outputs on edits: ask the target to rewrite real code (functions from Python's standard
library) with a small change, passing the original as the prediction, and compare decoding speed with
plain decoding and n-gram prompt lookup (which finds the same code in the prompt). Greedy, one thread;
outputs must be identical across methods.

    python experiments/prediction_edits.py [--target smollm2] [--functions 6] [--max-tokens 160] [--repeats 3]
"""

from __future__ import annotations

import argparse
import ast
import inspect
import json
import platform
import statistics
import textwrap

import torch

MODULES = ("textwrap", "shlex", "fnmatch", "colorsys", "bisect", "heapq")


def functions(count: int) -> list[tuple[str, str]]:
    """(name, source) of short top-level functions, a few per module."""
    import importlib

    found = []
    for module_name in MODULES:
        module = importlib.import_module(module_name)
        tree = ast.parse(inspect.getsource(module))
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
                source = ast.get_source_segment(inspect.getsource(module), node)
                if source and 4 <= source.count("\n") <= 14:
                    found.append((node.name, textwrap.dedent(source)))
                    break
    return found[:count]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2")
    parser.add_argument("--functions", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from verispec.config import SamplingParams, SpecConfig, StopRules
    from verispec.drafters.ngram import NgramDrafter
    from verispec.drafters.prediction import PREDICTION_DRAFTS, PredictionDrafter
    from verispec.engine import SpecEngine
    from verispec.loading import encode_prompt, eos_ids, load_pair

    torch.set_num_threads(1)
    pair = load_pair(args.target, need_draft=False)
    stop = StopRules(max_tokens=args.max_tokens, eos_ids=tuple(eos_ids(pair.tokenizer, pair.target)))
    greedy = SamplingParams(temperature=0)
    rows, totals = [], {"plain": [], "ngram": [], "prediction": []}
    for name, source in functions(args.functions):
        prompt = encode_prompt(pair.tokenizer, f"Rename the function {name} to {name}_v2 and change nothing else. "
                                               f"Reply with the code only.\n\n{source}", chat=True)
        prediction = pair.tokenizer.encode(source, add_special_tokens=False)
        runs = {"plain": (SpecEngine(pair.target), SpecConfig(method="none")),
                "ngram": (SpecEngine(pair.target, NgramDrafter(8, 1)), SpecConfig(gamma=PREDICTION_DRAFTS)),
                "prediction": (SpecEngine(pair.target, PredictionDrafter(prediction)), SpecConfig(gamma=PREDICTION_DRAFTS))}
        row, outputs = {"function": name}, {}
        for method, (engine, spec) in runs.items():
            seconds = []
            for _ in range(args.repeats):
                result = engine.generate(prompt, greedy, spec, stop)
                seconds.append(result.stats.e2e_s - result.stats.prefill_s)
            outputs[method] = result.tokens
            decode_ms = 1e3 * statistics.median(seconds) / max(1, len(result.tokens) - 1)
            row[f"{method}_ms_per_token"] = round(decode_ms, 2)
            row[f"{method}_committed_per_round"] = round(result.stats.committed_per_round, 2)
            totals[method].append(decode_ms)
        row["tokens"] = len(outputs["plain"])
        row["identical"] = outputs["plain"] == outputs["ngram"] == outputs["prediction"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    summary = {method: round(statistics.median(values), 2) for method, values in totals.items()}
    print(json.dumps({"cpu": platform.processor() or platform.machine(), "target": args.target,
                      "max_tokens": args.max_tokens, "repeats": args.repeats, "median_ms_per_token": summary,
                      "speedup_vs_plain": {m: round(summary["plain"] / v, 2) for m, v in summary.items()},
                      "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
