"""Train the default target from scratch with the LayerSkip recipe, within a wall-clock budget.

    metrics = train_target(TargetRecipe(), minutes=75, out_dir="verispec/data/target",
                           run_dir="runs/target", tokenizer_dir="verispec/data/target")
    metrics["heldout"]["code"]["final"]["loss"], metrics["heldout"]["code"]["exit4"]["greedy_agreement"]

The run dir collects train.log, metrics.json, loss.png and checkpoint-latest/ (refreshed every
``checkpoint_every_s``); the final checkpoint goes to ``out_dir``.
"""

from __future__ import annotations

import logging
import random
from dataclasses import asdict
from pathlib import Path

import torch

from verispec.models.llama import LlamaForCausalLM, load_checkpoint, parameter_count
from verispec.train import corpus
from verispec.train.artifacts import export_checkpoint, plot_losses, write_json
from verispec.train.evaluate import evaluate_layers, heldout_windows
from verispec.train.loop import BudgetedLoop, TrainHistory
from verispec.train.losses import layerskip_loss
from verispec.train.recipes import EOS_TOKEN_ID, EvalConfig, TargetRecipe
from verispec.train.token_stream import EncodeBatch, MixedTokenStream, WindowBatches
from verispec.train.tokenizer import batch_encoder, load_tokenizer

logger = logging.getLogger(__name__)


def init_weights(model: LlamaForCausalLM, std: float) -> None:
    """GPT-2 style init: N(0, std) everywhere, residual output projections scaled by 1/sqrt(2L), norms 1.

    The default nn.Embedding init (std 1) would make tied output logits huge at step 0.
    """
    residual_std = std / (2 * model.config.num_hidden_layers) ** 0.5
    for name, parameter in model.named_parameters():
        if parameter.dim() < 2:
            torch.nn.init.ones_(parameter) if name.endswith("norm.weight") else torch.nn.init.zeros_(parameter)
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            torch.nn.init.normal_(parameter, 0.0, residual_std)
        else:
            torch.nn.init.normal_(parameter, 0.0, std)


def training_batches(tokenizer_dir: str | Path, mix: dict, seq_len: int, micro_batch: int,
                     seed: int) -> tuple[MixedTokenStream, WindowBatches, EncodeBatch]:
    encode = batch_encoder(load_tokenizer(tokenizer_dir))
    stream = MixedTokenStream(encode, EOS_TOKEN_ID, mix, split="train", seed=seed)
    batches = WindowBatches(stream, seq_len, micro_batch, seed=seed)
    batches.prime()
    return stream, batches, encode


def evaluate_heldout(model: LlamaForCausalLM, encode: EncodeBatch, seq_len: int, config: EvalConfig,
                     exit_layers: list[int] | None = None) -> dict:
    """`evaluate_layers` on each workload's held-out windows."""
    results = {}
    for name in corpus.WORKLOADS:
        windows = heldout_windows(encode, name, seq_len, config.windows_per_workload, EOS_TOKEN_ID)
        results[name] = evaluate_layers(model, windows, config.micro_batch, exit_layers)
        results[name]["synthetic"] = name in corpus.SYNTHETIC_WORKLOADS
        logger.info("held-out %s: final loss %.3f", name, results[name]["final"]["loss"])
    return results


def history_summary(history: TrainHistory) -> dict:
    return {"steps": history.steps_done, "planned_steps": history.planned_steps,
            "tokens_seen": history.tokens_seen, "train_seconds": round(history.train_seconds, 1),
            "tokens_per_second": round(history.tokens_per_second, 1)}


def training_summary(history: TrainHistory, stream: MixedTokenStream) -> dict:
    """`history_summary` plus what the run read from each workload's stream (metrics' ``training``)."""
    return {**history_summary(history), "stream": stream.stats()}


def make_run_dir(run_dir: str | Path) -> Path:
    """``run_dir`` as a Path, created (with its parents) if missing."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


def fresh_model(model_class, recipe):
    """``model_class(recipe.model)`` built after seeding torch with ``recipe.optim.seed``, then `init_weights`."""
    torch.manual_seed(recipe.optim.seed)
    model = model_class(recipe.model)
    init_weights(model, recipe.init_std)
    return model


def save_history(run_dir: Path, history: TrainHistory, loss_keys: list[str], title: str) -> None:
    """The run dir's history.json (every logged record) and loss.png (``loss_keys`` against tokens)."""
    write_json(run_dir / "history.json", {"records": history.records})
    plot_losses(history.records, loss_keys, run_dir / "loss.png", title)


def train_target(recipe: TargetRecipe, minutes: float, out_dir: str | Path, run_dir: str | Path,
                 tokenizer_dir: str | Path, init_dir: str | Path | None = None) -> dict:
    run_dir = make_run_dir(run_dir)
    optim = recipe.optim
    model = fresh_model(LlamaForCausalLM, recipe)
    if init_dir is not None:  # continue a previous run: its weights, a fresh optimizer and schedule
        try:
            model.load_state_dict(load_checkpoint(init_dir, dtype=torch.float32, kernels=False).state_dict())
        except RuntimeError as err:  # missing / unexpected / mis-shaped tensors
            raise ValueError(f"--init {init_dir} does not fit the target recipe: {str(err).splitlines()[0]}") from None
        logger.info("target: continuing from %s", init_dir)
    logger.info("target: %d parameters, %s", parameter_count(model), recipe.model)
    stream, batches, encode = training_batches(tokenizer_dir, recipe.mix, optim.seq_len, optim.micro_batch,
                                               optim.seed)
    dropout_rng = random.Random(optim.seed)

    def loss_fn(tokens: torch.Tensor, micro_step: int):
        return layerskip_loss(model, tokens, recipe.layerskip, micro_step, dropout_rng)

    loss_keys = ["loss", "final_loss"] + [f"exit{e}_loss" for e in (2, 4, 6)]

    def save_latest(step: int, history: TrainHistory) -> None:
        export_checkpoint(model, run_dir / "checkpoint-latest", tokenizer_dir)
        write_json(run_dir / "checkpoint-latest" / "training_state.json", training_summary(history, stream))
        save_history(run_dir, history, loss_keys, "target training loss")

    history = BudgetedLoop(model, optim, minutes, on_checkpoint=save_latest).run(batches, loss_fn)
    export_checkpoint(model, out_dir, tokenizer_dir)
    save_history(run_dir, history, loss_keys, "target training loss")
    metrics = {
        "model": asdict(recipe.model), "parameters": parameter_count(model), "recipe": asdict(recipe),
        "init_dir": None if init_dir is None else str(init_dir),
        "training": training_summary(history, stream),
        "heldout": evaluate_heldout(model, encode, optim.seq_len, recipe.eval),
        "synthetic_workloads": sorted(corpus.SYNTHETIC_WORKLOADS),
    }
    write_json(run_dir / "metrics.json", metrics)
    write_json(Path(out_dir) / "training_metrics.json", metrics)
    logger.info("target done: %s", metrics["training"])
    return metrics
