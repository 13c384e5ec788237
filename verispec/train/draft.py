"""Distil the default draft model from a trained target checkpoint, within a wall-clock budget.

    metrics = train_draft(DraftRecipe(), minutes=30, target_dir="verispec/data/target",
                          out_dir="verispec/data/draft", run_dir="runs/draft")
    metrics["heldout"]["chat"]["expected_acceptance_t1"]   # P(one sampled draft token is accepted)

The loss is `losses.distillation_loss`: KL(target || draft) on the target's temperature-1
distributions over training text, mixed with cross-entropy on the real next token. The tokenizer is the
target's (copied from the target checkpoint dir).
"""

from __future__ import annotations

import logging
from dataclasses import asdict
from pathlib import Path

import torch

from verispec.models.llama import LlamaForCausalLM, load_checkpoint, parameter_count
from verispec.train import corpus
from verispec.train.artifacts import export_checkpoint, plot_losses, write_json
from verispec.train.evaluate import evaluate_draft, heldout_windows
from verispec.train.loop import BudgetedLoop, TrainHistory
from verispec.train.losses import distillation_loss
from verispec.train.recipes import EOS_TOKEN_ID, DraftRecipe
from verispec.train.target import history_summary, init_weights, training_batches

logger = logging.getLogger(__name__)


def train_draft(recipe: DraftRecipe, minutes: float, target_dir: str | Path, out_dir: str | Path,
                run_dir: str | Path) -> dict:
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    optim = recipe.optim
    teacher = load_checkpoint(target_dir, dtype=torch.float32).eval()
    for parameter in teacher.parameters():
        parameter.requires_grad_(False)
    if teacher.config.vocab_size != recipe.model.vocab_size:
        raise ValueError(f"target vocabulary ({teacher.config.vocab_size}) differs from the draft's "
                         f"({recipe.model.vocab_size}); both must share one tokenizer")
    torch.manual_seed(optim.seed)
    draft = LlamaForCausalLM(recipe.model)
    init_weights(draft, recipe.init_std)
    logger.info("draft: %d parameters (target %d)", parameter_count(draft), parameter_count(teacher))
    # Fresh seed: the draft sees the training split in a different order than the target did.
    stream, batches, encode = training_batches(target_dir, recipe.mix, optim.seq_len, optim.micro_batch,
                                               optim.seed)

    def loss_fn(tokens: torch.Tensor, micro_step: int):
        return distillation_loss(draft, teacher, tokens, recipe.ce_weight)

    loss_keys = ["loss", "kl", "ce"]

    def save_latest(step: int, history: TrainHistory) -> None:
        export_checkpoint(draft, run_dir / "checkpoint-latest", target_dir)
        write_json(run_dir / "history.json", {"records": history.records})
        plot_losses(history.records, loss_keys, run_dir / "loss.png", "draft distillation loss")

    history = BudgetedLoop(draft, optim, minutes, on_checkpoint=save_latest).run(batches, loss_fn)
    export_checkpoint(draft, out_dir, target_dir)
    write_json(run_dir / "history.json", {"records": history.records})
    plot_losses(history.records, loss_keys, run_dir / "loss.png", "draft distillation loss")
    heldout = {}
    for name in corpus.WORKLOADS:
        windows = heldout_windows(encode, name, optim.seq_len, recipe.eval.windows_per_workload, EOS_TOKEN_ID)
        heldout[name] = {**evaluate_draft(draft, teacher, windows, recipe.eval.micro_batch),
                         "synthetic": name in corpus.SYNTHETIC_WORKLOADS}
        logger.info("held-out %s: %s", name, heldout[name])
    metrics = {
        "model": asdict(recipe.model), "parameters": parameter_count(draft), "recipe": asdict(recipe),
        "target_dir": str(target_dir), "training": {**history_summary(history), "stream": stream.stats()},
        "heldout": heldout, "synthetic_workloads": sorted(corpus.SYNTHETIC_WORKLOADS),
    }
    write_json(run_dir / "metrics.json", metrics)
    write_json(Path(out_dir) / "training_metrics.json", metrics)
    return metrics
