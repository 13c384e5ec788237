"""Train a compressed-attention target (``models.compressed``) on the default mix, within a wall-clock budget.

    metrics = train_compressed(CompressedRecipe(), minutes=10, out_dir="runs/compressed/model",
                               run_dir="runs/compressed", tokenizer_dir="verispec/data/target",
                               draft_dir="verispec/data/draft")
    metrics["heldout"]["code"]["loss"], metrics["draft_vs_target"]["code"]["expected_acceptance_t1"]

Used for the speed figures of speculation on compressed attention; correctness tests use random instances.
The checkpoint dir holds config.json (model_type verispec_compressed), model.safetensors and the tokenizer.
"""

from __future__ import annotations

import logging
from dataclasses import asdict
from pathlib import Path

import torch

from verispec.models.compressed import CompressedForCausalLM, save_checkpoint
from verispec.models.llama import load_checkpoint, parameter_count
from verispec.train import corpus
from verispec.train.artifacts import CHECKPOINT_DTYPE, copy_tokenizer, write_json
from verispec.train.evaluate import evaluate_draft, heldout_windows
from verispec.train.loop import BudgetedLoop
from verispec.train.losses import next_token_loss
from verispec.train.recipes import EOS_TOKEN_ID, CompressedRecipe
from verispec.train.target import fresh_model, make_run_dir, save_history, training_batches, training_summary

logger = logging.getLogger(__name__)


def export(model: CompressedForCausalLM, out_dir: str | Path, tokenizer_dir: str | Path) -> None:
    save_checkpoint(model, out_dir, dtype=CHECKPOINT_DTYPE)
    copy_tokenizer(tokenizer_dir, out_dir)


def train_compressed(recipe: CompressedRecipe, minutes: float, out_dir: str | Path, run_dir: str | Path,
                     tokenizer_dir: str | Path, draft_dir: str | Path | None = None) -> dict:
    run_dir = make_run_dir(run_dir)
    optim = recipe.optim
    model = fresh_model(CompressedForCausalLM, recipe)
    logger.info("compressed target: %d parameters, %s", parameter_count(model), recipe.model)
    stream, batches, encode = training_batches(tokenizer_dir, recipe.mix, optim.seq_len, optim.micro_batch,
                                               optim.seed)

    def loss_fn(tokens: torch.Tensor, micro_step: int):
        logits, _ = model.train_forward(tokens[:, :-1])
        return next_token_loss(logits, tokens[:, 1:]), {}

    history = BudgetedLoop(model, optim, minutes).run(batches, loss_fn)
    export(model, out_dir, tokenizer_dir)
    save_history(run_dir, history, ["loss"], "compressed target training loss")
    draft = load_checkpoint(draft_dir) if draft_dir is not None else None
    heldout, versus = {}, {}
    for name in corpus.WORKLOADS:
        windows = heldout_windows(encode, name, optim.seq_len, recipe.eval.windows_per_workload, EOS_TOKEN_ID)
        with torch.no_grad():
            logits, _ = model.train_forward(windows[:, :-1])
        loss = next_token_loss(logits, windows[:, 1:]).item()
        heldout[name] = {"loss": loss, "perplexity": float(torch.tensor(loss).exp())}
        if draft is not None:  # how well the draft shipped for the Llama target drafts for this model
            versus[name] = evaluate_draft(draft, model, windows, recipe.eval.micro_batch)
        logger.info("held-out %s: loss %.3f", name, loss)
    metrics = {"model": asdict(recipe.model), "parameters": parameter_count(model),
               "training": training_summary(history, stream),
               "heldout": heldout, "draft_vs_target": versus}
    write_json(run_dir / "metrics.json", metrics)
    logger.info("compressed target done: %s", metrics["training"])
    return metrics
