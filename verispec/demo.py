"""``verispec demo``: held-out prompts per workload, speculation off vs on, side by side in one run.

For every prompt the target decodes greedily with speculation off, then with a chain of draft-model
proposals; the table reports tokens/s of each, their ratio, committed tokens per round, the draft
acceptance rate and whether the speculative output is token-for-token identical to plain decoding.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from verispec.config import SamplingParams, SpecConfig, StopRules
from verispec.errors import VerispecError
from verispec.loading import DATA_DIR, ModelPair, build_engine, embedded_pair_available, load_pair

PROMPTS_FILE = DATA_DIR / "heldout_prompts.json"
FALLBACK_PROMPTS = {
    "code": ["def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"],
    "chat": ["<|user|>\nWhat is speculative decoding?\n<|assistant|>\n"],
}


def demo_prompts(per_workload: int) -> dict[str, list[str]]:
    if PROMPTS_FILE.is_file():
        prompts = json.loads(PROMPTS_FILE.read_text())
    else:
        prompts = FALLBACK_PROMPTS
    return {name: items[:per_workload] for name, items in prompts.items()}


def run_demo(args) -> int:
    from tqdm import tqdm

    if args.max_tokens < 1 or args.prompts < 1 or args.threads < 0:
        raise VerispecError("--max-tokens and --prompts must be >= 1, --threads >= 0")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    pair, note = _load_demo_pair()
    if note:
        print(note, file=sys.stderr)
    sampling = SamplingParams(temperature=0.0)
    off, on = SpecConfig(method="none"), SpecConfig(method="chain", gamma=args.gamma)
    engines = {"off": build_engine(pair, off), "on": build_engine(pair, on)}
    eos = tuple(sorted(set(pair.target.config.eos_ids) | {pair.tokenizer.eos_token_id} - {None}))
    stop = StopRules(max_tokens=args.max_tokens, eos_ids=eos)
    prompts = demo_prompts(args.prompts)

    warm = pair.tokenizer.encode("def main():", add_special_tokens=False)
    for name in engines:  # first calls pay one-off allocation costs; keep them out of the table
        engines[name].generate(warm, sampling, off if name == "off" else on, StopRules(max_tokens=8))

    rows, sample = [], None
    jobs = [(w, p) for w, items in prompts.items() for p in items]
    for workload, prompt in tqdm(jobs, desc="demo", unit="prompt", file=sys.stderr):
        ids = pair.tokenizer.encode(prompt, add_special_tokens=False)
        plain = engines["off"].generate(ids, sampling, off, stop)
        spec = engines["on"].generate(ids, sampling, on, stop)
        rows.append({
            "workload": workload,
            "tokens": spec.stats.generated_tokens,
            "off_tokens_per_s": plain.stats.tokens_per_s,
            "on_tokens_per_s": spec.stats.tokens_per_s,
            "speedup": spec.stats.tokens_per_s / plain.stats.tokens_per_s,
            "committed_per_round": spec.stats.committed_per_round,
            "acceptance_rate": spec.stats.acceptance_rate,
            "identical": spec.tokens == plain.tokens,
        })
        if sample is None:
            sample = {"prompt": prompt, "output": pair.tokenizer.decode(spec.tokens, skip_special_tokens=True)}
    by_workload = _aggregate(rows)
    if args.json:
        print(json.dumps({"embedded_pair": note is None, "gamma": args.gamma, "max_tokens": args.max_tokens,
                          "prompts": rows, "workloads": by_workload, "sample": sample}))
        return 0
    print(_table(by_workload))
    print(f"\nchain, gamma {args.gamma}, greedy, {args.max_tokens} tokens per prompt; speedup = tokens/s with "
          "speculation on / off, measured in this run")
    print("\nsample (" + by_workload[0]["workload"] + "):\n" + sample["prompt"] + sample["output"])
    return 0 if all(r["identical"] for r in rows) else 1


def _aggregate(rows: list[dict]) -> list[dict]:
    out = []
    for workload in dict.fromkeys(r["workload"] for r in rows):
        group = [r for r in rows if r["workload"] == workload]
        n = len(group)
        off = sum(r["tokens"] for r in group) / sum(r["tokens"] / r["off_tokens_per_s"] for r in group)
        on = sum(r["tokens"] for r in group) / sum(r["tokens"] / r["on_tokens_per_s"] for r in group)
        out.append({
            "workload": workload, "prompts": n, "off_tokens_per_s": off, "on_tokens_per_s": on,
            "speedup": on / off,
            "committed_per_round": sum(r["committed_per_round"] for r in group) / n,
            "acceptance_rate": sum(r["acceptance_rate"] for r in group) / n,
            "identical": all(r["identical"] for r in group),
        })
    return out


def _table(rows: list[dict]) -> str:
    header = ("workload", "prompts", "off tok/s", "on tok/s", "speedup", "committed/round", "acceptance",
              "greedy identical")
    lines = [header] + [(
        r["workload"], str(r["prompts"]), f"{r['off_tokens_per_s']:.1f}", f"{r['on_tokens_per_s']:.1f}",
        f"{r['speedup']:.2f}x", f"{r['committed_per_round']:.2f}", f"{r['acceptance_rate']:.2f}",
        "yes" if r["identical"] else "NO") for r in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths)) for line in lines)


def _load_demo_pair() -> tuple[ModelPair, str | None]:
    if embedded_pair_available():
        return load_pair(), None
    from verispec.testing import make_random_pair

    directory = Path(tempfile.gettempdir()) / "verispec-random-pair"
    target_dir, draft_dir = make_random_pair(directory)
    note = ("NOTE: the embedded trained pair is not installed; this demo uses a small RANDOM checkpoint "
            f"pair built in {directory} (acceptance and speed mean nothing here).")
    return load_pair(target_dir, draft_dir), note
