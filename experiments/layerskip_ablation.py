"""Does the LayerSkip recipe make early exits draft better? Two targets trained from scratch on the same
data, seed and wall time, one with the recipe (`verispec train target`) and one without
(`--no-layerskip`): held-out loss of the full model and of each exit (from their
training_metrics.json), and greedy self-speculation acceptance (chain, gamma 4) per exit layer on the
benchmark's held-out prompts, with 95% bootstrap intervals over prompts.

    verispec train target --minutes 20 --threads 1 --seed 3 --out runs/ablation-ls/model &
    verispec train target --minutes 20 --threads 1 --seed 3 --no-layerskip --out runs/ablation-plain/model &
    OMP_NUM_THREADS=2 python experiments/layerskip_ablation.py runs/ablation-ls/model runs/ablation-plain/model
"""
import argparse, json, sys
from pathlib import Path
from tqdm import tqdm
from verispec.loading import load_model, load_tokenizer
from verispec.train.card import early_exit_acceptance, heldout_bench_prompts

ap = argparse.ArgumentParser()
ap.add_argument("layerskip", help="target trained with the recipe")
ap.add_argument("plain", help="target trained with --no-layerskip")
ap.add_argument("--prompts", type=int, default=32, help="held-out prompts per workload")
ap.add_argument("--max-tokens", type=int, default=64)
args = ap.parse_args()
models = {"layerskip": load_model(args.layerskip), "plain": load_model(args.plain)}
layers = models["plain"].config.num_hidden_layers
prompts = heldout_bench_prompts(load_tokenizer(args.layerskip), models["plain"].config.max_context, args.prompts,
                                args.max_tokens)

for name, path in (("layerskip", args.layerskip), ("plain", args.plain)):
    metrics = json.loads((Path(path) / "training_metrics.json").read_text())
    training = metrics["training"]
    print(f"{name}: {training['steps']} steps, {training['tokens_seen']:,} tokens, "
          f"{training['tokens_per_second']:.0f} tokens/s", flush=True)
    for workload, values in metrics["heldout"].items():
        exits = " ".join(f"{v['loss']:.2f}" for k, v in values.items() if k.startswith("exit"))
        print(f"  held-out {workload}: final loss {values['final']['loss']:.3f}; exit 1..{layers - 1} losses {exits}",
              flush=True)

progress = tqdm(total=2 * (layers - 1) * sum(map(len, prompts.values())), desc="early exits", file=sys.stderr)
rows = {name: early_exit_acceptance(model, prompts, args.max_tokens, progress) for name, model in models.items()}
progress.close()
print("greedy early-exit acceptance, gamma 4:", {w: len(p) for w, p in prompts.items()}, "prompts")
for exit_layer in map(str, range(1, layers)):
    cells = []
    for workload in prompts:
        for name in models:
            got = rows[name][exit_layer][workload]
            low, high = got["acceptance_interval"]
            cells.append(f"{workload} {name} {got['acceptance_rate']:.3f} [{low:.3f}-{high:.3f}]")
    print(f"  exit {exit_layer}: " + "; ".join(cells), flush=True)
