"""SmolLM2-135M with its shipped draft and EAGLE head on a GPU: greedy identity of every method with plain
decoding, and tokens/s medians, one request at a time (SpecEngine) and all prompts as one batch
(BatchEngine). Also the GPU's logits against the CPU's for the same GGUF file. Writes JSON.

    python experiments/gpu_check.py --target SmolLM2-135M-Instruct.Q4_1.gguf --out gpu.json

Meant for a short lease on a GPU machine: each method runs in its own try block (a failure is recorded,
the rest go on) and repeats stop once ``--budget-s`` is spent.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
import traceback

import torch

from verispec.batch import BatchEngine, BatchRequest
from verispec.bench.planner_check import split_prompts
from verispec.config import SamplingParams, SpecConfig, StopRules
from verispec.loading import DATA_DIR, build_engine, load_pair

SPECS = {"off": SpecConfig(method="none"), "chain": SpecConfig(gamma=5),
         "tree": SpecConfig(method="tree", tree="s3_k2_d6"), "eagle": SpecConfig(gamma=5, drafter="eagle"),
         "eagle-tree": SpecConfig(method="tree", tree="s3_k2_d6", drafter="eagle"),
         "ngram": SpecConfig(gamma=5, drafter="ngram"), "self": SpecConfig(gamma=3, drafter="early_exit", exit_layer=8)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True, help="the SmolLM2 GGUF file")
    parser.add_argument("--draft", default=str(DATA_DIR / "smollm2-draft"))
    parser.add_argument("--eagle", default=str(DATA_DIR / "smollm2-eagle"))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--methods", default=",".join(SPECS))
    parser.add_argument("--prompts", type=int, default=2, help="held-out prompts per workload (code, chat, math)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--budget-s", type=float, default=240.0)
    parser.add_argument("--out", default="gpu_check.json")
    args = parser.parse_args()
    began = time.perf_counter()
    report: dict = {"torch": torch.__version__, "cuda": torch.version.cuda, "cpu": platform.processor(),
                    "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
                    "max_tokens": args.max_tokens, "methods": {}, "errors": {}}

    def save() -> None:
        report["elapsed_s"] = round(time.perf_counter() - began, 1)
        with open(args.out, "w") as handle:
            json.dump(report, handle, indent=1)

    pair = load_pair(args.target, args.draft, device=args.device, draft_weights="native", need_eagle=True,
                     eagle_dir=args.eagle)
    report["load_s"] = round(time.perf_counter() - began, 1)
    try:
        report["logits_vs_cpu"] = logits_against_cpu(pair, args.target)
    except Exception:  # noqa: BLE001 - recorded, the timing goes on
        report["errors"]["logits_vs_cpu"] = traceback.format_exc()
    save()
    prompts, _ = split_prompts(pair.tokenizer, args.prompts, 512)
    greedy, stop = SamplingParams(temperature=0), StopRules(max_tokens=args.max_tokens, ignore_eos=True)
    plain_tokens: list[list[int]] | None = None
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    for name in args.methods.split(","):
        spec = SPECS[name]
        try:
            engine = build_engine(pair, spec)
            rates, tokens, drafted, accepted = [], None, 0, 0
            for repeat in range(args.repeats + 1):  # the first pass warms up (allocator, kernels)
                sync()
                start = time.perf_counter()
                results = [engine.generate(p, greedy, spec, stop) for p in prompts]
                elapsed = time.perf_counter() - start
                tokens = [r.tokens for r in results]
                if repeat:
                    rates.append(sum(len(t) for t in tokens) / elapsed)
                    drafted += sum(r.stats.drafted for r in results)
                    accepted += sum(r.stats.accepted for r in results)
                if repeat and time.perf_counter() - began > args.budget_s:
                    break
            if name == "off":
                plain_tokens = tokens
            entry = {"tok_s": round(statistics.median(rates), 1), "repeats": len(rates),
                     "acceptance": round(accepted / drafted, 3) if drafted else None,
                     "identical_to_plain": None if plain_tokens is None else tokens == plain_tokens}
            if plain_tokens is not None and tokens != plain_tokens:
                entry["first_divergence"] = [first_difference(a, b) for a, b in zip(tokens, plain_tokens)]
            if name in ("off", "chain", "tree", "eagle"):
                entry["batch"] = batched(pair, spec, prompts, greedy, stop, plain_tokens)
            report["methods"][name] = entry
        except Exception:  # noqa: BLE001 - recorded, the other methods go on
            report["errors"][name] = traceback.format_exc()
        save()
        print(name, report["methods"].get(name) or report["errors"][name].splitlines()[-1], flush=True)
    off = report["methods"].get("off", {}).get("tok_s")
    for entry in report["methods"].values():
        if off:
            entry["vs_plain"] = round(entry["tok_s"] / off, 2)
    save()
    print(json.dumps(report, indent=1))


def batched(pair, spec, prompts, greedy, stop, plain_tokens, repeats: int = 2) -> dict:
    """All prompts as one batch through BatchEngine: total tokens/s (median), identical to plain."""
    engine = BatchEngine(pair.target, pair.draft, spec, max_batch=len(prompts), eagle=pair.eagle)
    rates, out = [], {}
    for repeat in range(repeats + 1):
        out = {}
        start = time.perf_counter()
        events = []
        for i, prompt in enumerate(prompts):
            events += engine.add(BatchRequest(str(i), prompt, greedy, stop, seed=i))
        while True:
            for event in events:
                out.setdefault(event.request_id, []).extend(event.tokens)
            if not engine.active:
                break
            events = engine.step()
        if repeat:
            rates.append(sum(len(t) for t in out.values()) / (time.perf_counter() - start))
    tokens = [out[str(i)] for i in range(len(prompts))]
    return {"rows": len(prompts), "tok_s": round(statistics.median(rates), 1),
            "identical_to_plain": None if plain_tokens is None else tokens == plain_tokens}


def logits_against_cpu(pair, target_path: str) -> dict:
    """The same prompt through the GPU model and the CPU model of the same file."""
    from verispec.loading import load_model

    ids = torch.tensor([pair.tokenizer.encode("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.")])
    cpu_model = load_model(target_path, "cpu")
    with torch.inference_mode():
        gpu = pair.target.train_forward(ids.to(next(pair.target.parameters()).device))[0][0].float().cpu()
        cpu = cpu_model.train_forward(ids)[0][0].float()
    return {"positions": ids.shape[1], "max_abs_diff": float((gpu - cpu).abs().max()),
            "argmax_agree": int((gpu.argmax(-1) == cpu.argmax(-1)).sum())}


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


if __name__ == "__main__":
    main()
