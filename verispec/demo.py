"""``verispec demo``: held-out prompts per workload, speculation off vs on, side by side in one run.

For every prompt the target decodes greedily with speculation off, then with each method in
``--methods``: ``chain`` (the draft model proposes gamma tokens in a line), ``tree`` (it proposes a
candidate tree, ``--tree``), ``ngram`` (continuations found earlier in the context, no draft model)
and ``self`` (the target's first ``--exit-layer`` layers draft). The table reports, per workload and
method, tokens/s off and on, their ratio, committed tokens per round, the acceptance rate and whether
the speculative output is token-for-token identical to plain decoding.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import tempfile
from pathlib import Path

from verispec.config import SamplingParams, SpecConfig, StopRules
from verispec.drafters.lookup_first import DEFAULT_MIN_N as LOOKUP_MIN_N
from verispec.errors import VerispecError
from verispec.loading import (DATA_DIR, DEFAULT_TARGET_NAME, ModelPair, build_single, embedded_pair_available,
                              load_pair, resolve_draft_vocab)

# Held-out prompts (never trained on): code and math are plain text; chat is rendered in each target's
# own chat template (the SmolLM2 file: corpus.heldout_prompts("chat", 8, gguf_draft.chat_renderer(tok))).
PROMPTS_FILE = DATA_DIR / "heldout_prompts.json"
PROMPT_FILES = {"tiny": PROMPTS_FILE, "smollm2": DATA_DIR / "smollm2_heldout_prompts.json"}
FALLBACK_PROMPTS = {
    "code": ["def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"],
    "chat": ["<|user|>\nWhat is speculative decoding?\n<|assistant|>\n"],
}


def demo_prompts(per_workload: int, target: str = "tiny") -> dict[str, list[str]]:
    path = PROMPT_FILES.get(target, PROMPTS_FILE)
    if path.is_file():
        prompts = json.loads(path.read_text())
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
    target = args.target or DEFAULT_TARGET_NAME
    specs = method_specs(args.methods, args.gamma, args.tree, args.exit_layer)
    pair, note = _load_demo_pair(target, any(spec.drafter == "eagle" for spec in specs.values()))
    if pair.eagle is None and any(spec.drafter == "eagle" for spec in specs.values()):
        specs = {name: spec for name, spec in specs.items() if spec.drafter != "eagle"}
        note += " The EAGLE methods are left out: the random pair has no head."
        if not specs:
            raise VerispecError("--methods: only EAGLE methods were asked for, and the random pair has no head")
    if note:
        print(note, file=sys.stderr)
    sampling = SamplingParams(temperature=0.0)
    off = SpecConfig(method="none")
    vocab = resolve_draft_vocab(pair, "auto")  # a shipped draft proposes its most frequent ids only
    specs = {name: dataclasses.replace(spec, draft_vocab=vocab) if spec.drafter == "model" else spec
             for name, spec in specs.items()}
    engines = {"off": build_single(pair, off), **{name: build_single(pair, spec) for name, spec in specs.items()}}
    configs = {"off": off, **specs}
    eos = tuple(sorted(set(pair.target.config.eos_ids) | {pair.tokenizer.eos_token_id} - {None}))
    stop = StopRules(max_tokens=args.max_tokens, eos_ids=eos)
    prompts = demo_prompts(args.prompts, target if note is None else "tiny")

    warm = pair.tokenizer.encode("def main():", add_special_tokens=False)
    for name, engine in engines.items():  # first calls pay one-off allocation costs; keep them out of the table
        engine.generate(warm, sampling, configs[name], StopRules(max_tokens=8))

    rows, sample = [], None
    jobs = [(w, p) for w, items in prompts.items() for p in items]
    for workload, prompt in tqdm(jobs, desc="demo", unit="prompt", file=sys.stderr):
        ids = pair.tokenizer.encode(prompt, add_special_tokens=False)
        plain = engines["off"].generate(ids, sampling, off, stop)
        for method, spec in specs.items():  # each method right after the plain run it is compared with
            result = engines[method].generate(ids, sampling, spec, stop)
            rows.append({
                "workload": workload, "method": method,
                "tokens": result.stats.generated_tokens,
                "off_tokens_per_s": plain.stats.tokens_per_s,
                "on_tokens_per_s": result.stats.tokens_per_s,
                "speedup": result.stats.tokens_per_s / plain.stats.tokens_per_s,
                "committed_per_round": result.stats.committed_per_round,
                "acceptance_rate": result.stats.acceptance_rate,
                "identical": result.tokens == plain.tokens,
            })
            if sample is None:
                sample = {"prompt": prompt, "output": pair.tokenizer.decode(result.tokens, skip_special_tokens=True)}
    by_workload = _aggregate(rows)
    if args.json:
        print(json.dumps({"target": target, "embedded_pair": note is None, "gamma": args.gamma, "tree": args.tree,
                          "exit_layer": args.exit_layer, "max_tokens": args.max_tokens,
                          "prompts": rows, "workloads": by_workload, "sample": sample}))
        return 0 if all(r["identical"] for r in rows) else 1
    print(_table(by_workload))
    print(f"\ngreedy, {args.max_tokens} tokens per prompt; " + "; ".join(_describe(m, specs[m]) for m in specs)
          + ".\nspeedup = tokens/s with speculation on / off, each method right after its plain run, in this run")
    print("\nsample (" + by_workload[0]["workload"] + ", " + by_workload[0]["method"] + "):\n"
          + sample["prompt"] + sample["output"])
    return 0 if all(r["identical"] for r in rows) else 1


DEMO_METHODS = ("chain", "tree", "ngram", "self", "eagle", "eagle-tree", "eagle-lookup")
EAGLE_DEMO_TREE = "dynamic:8"  # the EAGLE head's tree in the demo


def method_specs(methods: str, gamma: int, tree: str, exit_layer: int) -> dict[str, SpecConfig]:
    """``chain,tree,eagle,ngram,self`` -> one SpecConfig per named method, in the order given."""
    names = [name.strip() for name in methods.split(",") if name.strip()]
    unknown = [name for name in names if name not in DEMO_METHODS]
    if unknown or not names:
        raise VerispecError(f"--methods: unknown {', '.join(unknown) or '(none given)'}; "
                            f"choose from {', '.join(DEMO_METHODS)}")
    build = {
        "chain": lambda: SpecConfig(method="chain", gamma=gamma),
        "tree": lambda: SpecConfig(method="tree", tree=tree),
        "ngram": lambda: SpecConfig(method="chain", gamma=gamma, drafter="ngram"),
        "self": lambda: SpecConfig(method="chain", gamma=gamma, drafter="early_exit", exit_layer=exit_layer),
        "eagle": lambda: SpecConfig(method="chain", gamma=gamma, drafter="eagle"),
        "eagle-tree": lambda: SpecConfig(method="tree", tree=EAGLE_DEMO_TREE, drafter="eagle"),
        "eagle-lookup": lambda: SpecConfig(method="chain", gamma=gamma, drafter="eagle", lookup=LOOKUP_MIN_N),
    }
    return {name: build[name]() for name in dict.fromkeys(names)}


def _describe(name: str, spec: SpecConfig) -> str:
    if name == "tree":
        return f"tree {spec.tree}"
    if name == "eagle-tree":
        return f"EAGLE head, tree {spec.tree}"
    if name == "eagle":
        return f"EAGLE head, chain gamma {spec.gamma}"
    if name == "eagle-lookup":
        return f"lookup first (repeats of {spec.lookup}+ tokens), else the EAGLE head, gamma {spec.gamma}"
    if name == "self":
        return f"self: first {spec.exit_layer} layers draft, gamma {spec.gamma}"
    return f"{name} gamma {spec.gamma}"


def _aggregate(rows: list[dict]) -> list[dict]:
    out = []
    for workload, method in dict.fromkeys((r["workload"], r["method"]) for r in rows):
        group = [r for r in rows if r["workload"] == workload and r["method"] == method]
        n = len(group)
        off = sum(r["tokens"] for r in group) / sum(r["tokens"] / r["off_tokens_per_s"] for r in group)
        on = sum(r["tokens"] for r in group) / sum(r["tokens"] / r["on_tokens_per_s"] for r in group)
        out.append({
            "workload": workload, "method": method, "prompts": n, "off_tokens_per_s": off, "on_tokens_per_s": on,
            "speedup": on / off,
            "committed_per_round": sum(r["committed_per_round"] for r in group) / n,
            "acceptance_rate": sum(r["acceptance_rate"] for r in group) / n,
            "identical": all(r["identical"] for r in group),
        })
    return out


def _table(rows: list[dict]) -> str:
    header = ("workload", "method", "prompts", "off tok/s", "on tok/s", "speedup", "committed/round", "acceptance",
              "greedy identical")
    lines = [header] + [(
        r["workload"], r["method"], str(r["prompts"]), f"{r['off_tokens_per_s']:.1f}", f"{r['on_tokens_per_s']:.1f}",
        f"{r['speedup']:.2f}x", f"{r['committed_per_round']:.2f}", f"{r['acceptance_rate']:.2f}",
        "yes" if r["identical"] else "NO") for r in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths)) for line in lines)


def _load_demo_pair(target: str, need_eagle: bool = False) -> tuple[ModelPair, str | None]:
    if target != "tiny" or embedded_pair_available():
        return load_pair(target, need_eagle=need_eagle), None
    from verispec.testing import make_random_pair

    directory = Path(tempfile.gettempdir()) / "verispec-random-pair"
    target_dir, draft_dir = make_random_pair(directory)
    note = ("NOTE: the embedded trained pair is not installed; this demo uses a small RANDOM checkpoint "
            f"pair built in {directory} (acceptance and speed mean nothing here).")
    return load_pair(target_dir, draft_dir), note
