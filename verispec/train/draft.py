"""Distil the default draft model from a trained target checkpoint, within a wall-clock budget.

    metrics = train_draft(DraftRecipe(), minutes=30, target_dir="verispec/data/target",
                          out_dir="verispec/data/draft", run_dir="runs/draft")
    metrics["heldout"]["chat"]["expected_acceptance_t1"]   # P(one sampled draft token is accepted)

The loss is `losses.distillation_loss`: KL(target || draft) on the target's temperature-1
distributions, mixed with cross-entropy on the next token (and optionally on the target's argmax),
over training text and (a ``target_sample_fraction`` of micro-batches) over continuations the target
sampled itself. The tokenizer is the target's (copied from the target checkpoint dir). A warm start
(``init_dir``) may have fewer layers (the extra ones start as the identity, ``grow_from``) and wider
MLPs (they keep their busiest neurons, ``narrow_mlps``).
"""

from __future__ import annotations

import logging
from dataclasses import asdict, replace
from pathlib import Path
from typing import Iterator

import torch

from verispec.models.llama import LlamaForCausalLM, load_checkpoint, parameter_count
from verispec.train import corpus
from verispec.train.artifacts import export_checkpoint, write_json
from verispec.train.evaluate import evaluate_draft, heldout_windows
from verispec.train.loop import BudgetedLoop, TrainHistory
from verispec.train.losses import distillation_loss
from verispec.train.recipes import EOS_TOKEN_ID, DraftRecipe
from verispec.train.target import fresh_model, make_run_dir, save_history, training_batches, training_summary

logger = logging.getLogger(__name__)


def train_draft(recipe: DraftRecipe, minutes: float, target_dir: str | Path, out_dir: str | Path,
                run_dir: str | Path, init_dir: str | Path | None = None) -> dict:
    run_dir = make_run_dir(run_dir)
    optim = recipe.optim
    teacher = load_checkpoint(target_dir, dtype=torch.float32).eval()
    for parameter in teacher.parameters():
        parameter.requires_grad_(False)
    if teacher.config.vocab_size != recipe.model.vocab_size:
        raise ValueError(f"target vocabulary ({teacher.config.vocab_size}) differs from the draft's "
                         f"({recipe.model.vocab_size}); both must share one tokenizer")
    draft = fresh_model(LlamaForCausalLM, recipe)
    # Fresh seed: the draft sees the training split in a different order than the target did.
    stream, batches, encode = training_batches(target_dir, recipe.mix, optim.seq_len, optim.micro_batch,
                                               optim.seed)
    if init_dir is not None:
        source = load_checkpoint(init_dir, dtype=torch.float32, kernels=False)
        if source.config.intermediate_size > recipe.model.intermediate_size:
            source = narrow_mlps(source, recipe.model.intermediate_size, next(batches)[:, :-1])
            logger.info("draft: %s's MLPs narrowed to their %d busiest neurons", init_dir,
                        recipe.model.intermediate_size)
        grow_from(draft, source)
        logger.info("draft: warm start from %s", init_dir)
    logger.info("draft: %d parameters (target %d)", parameter_count(draft), parameter_count(teacher))

    samples = TargetSamples(teacher, batches, recipe.sample_prefix, optim.seed, recipe.greedy_sample_fraction)
    batches = MixedBatches(batches, samples, recipe.target_sample_fraction)

    def loss_fn(tokens: torch.Tensor, micro_step: int):
        return distillation_loss(draft, teacher, tokens, recipe.ce_weight, recipe.argmax_weight)

    loss_keys = ["loss", "kl", "ce", "argmax_ce"]

    def save_latest(step: int, history: TrainHistory) -> None:
        export_checkpoint(draft, run_dir / "checkpoint-latest", target_dir)
        save_history(run_dir, history, loss_keys, "draft distillation loss")

    history = BudgetedLoop(draft, optim, minutes, on_checkpoint=save_latest).run(batches, loss_fn)
    export_checkpoint(draft, out_dir, target_dir)
    save_history(run_dir, history, loss_keys, "draft distillation loss")
    heldout = {}
    for name in corpus.WORKLOADS:
        windows = heldout_windows(encode, name, optim.seq_len, recipe.eval.windows_per_workload, EOS_TOKEN_ID)
        heldout[name] = {**evaluate_draft(draft, teacher, windows, recipe.eval.micro_batch),
                         "synthetic": name in corpus.SYNTHETIC_WORKLOADS}
        logger.info("held-out %s: %s", name, heldout[name])
    metrics = {
        "model": asdict(recipe.model), "parameters": parameter_count(draft), "recipe": asdict(recipe),
        "target_dir": str(target_dir), "init_dir": None if init_dir is None else str(init_dir),
        "training": training_summary(history, stream),
        "heldout": heldout, "synthetic_workloads": sorted(corpus.SYNTHETIC_WORKLOADS),
    }
    write_json(run_dir / "metrics.json", metrics)
    write_json(Path(out_dir) / "training_metrics.json", metrics)
    return metrics


def grow_from(draft: LlamaForCausalLM, source: LlamaForCausalLM) -> None:
    """Copy ``source``'s weights into ``draft``, which may have more layers (same widths otherwise).

    Every extra layer keeps its fresh weights except its output projections (o_proj, down_proj), which
    are zeroed: the extra layer starts as the identity on the residual stream, so the grown draft
    computes exactly what ``source`` computes and distillation starts from its quality."""
    mine, theirs = draft.state_dict(), source.state_dict()
    if source.config.num_hidden_layers > draft.config.num_hidden_layers:
        raise ValueError(f"cannot shrink a {source.config.num_hidden_layers}-layer draft to "
                         f"{draft.config.num_hidden_layers} layers")
    for name, value in theirs.items():
        if name not in mine or mine[name].shape != value.shape:
            raise ValueError(f"--init checkpoint does not fit the draft recipe at {name}: "
                             f"{tuple(value.shape)} vs {tuple(mine[name].shape) if name in mine else 'absent'}")
        mine[name] = value
    for name in mine:
        if name not in theirs and name.endswith(("o_proj.weight", "down_proj.weight")):
            mine[name] = torch.zeros_like(mine[name])
    draft.load_state_dict(mine)


@torch.no_grad()
def narrow_mlps(model: LlamaForCausalLM, width: int, tokens: torch.Tensor) -> LlamaForCausalLM:
    """A copy of ``model`` whose MLPs keep only the ``width`` neurons that carry the most on ``tokens`` (B, T).

    A neuron's share is its mean |silu(gate) * up| on the tokens times the norm of its down_proj column:
    what it adds to the residual stream. Dropping the quietest ones lets a wider draft give up MLP
    width for depth while starting close to what it computed before."""
    if width > model.config.intermediate_size:
        raise ValueError(f"cannot widen MLPs from {model.config.intermediate_size} to {width} neurons")
    activity = []
    hooks = [layer.mlp.down_proj.register_forward_pre_hook(
        lambda module, inputs: activity.append(inputs[0].abs().mean(dim=(0, 1))))
        for layer in model.model.layers]
    try:
        model.train_forward(tokens)
    finally:
        for hook in hooks:
            hook.remove()
    narrow = LlamaForCausalLM(replace(model.config, intermediate_size=width))
    state = model.state_dict()
    for index, layer in enumerate(model.model.layers):
        share = activity[index] * layer.mlp.down_proj.weight.norm(dim=0)  # (I,)
        keep = share.topk(width).indices.sort().values
        prefix = f"model.layers.{index}.mlp."
        for name in ("gate_proj.weight", "up_proj.weight"):
            state[prefix + name] = state[prefix + name][keep]
        state[prefix + "down_proj.weight"] = state[prefix + "down_proj.weight"][:, keep]
    narrow.load_state_dict(state)
    return narrow


class TargetSamples:
    """Windows (B, T + 1): a training-text prefix, then tokens the target generated itself: sampled at
    temperature 1, or greedily for every ``round(1 / greedy_fraction)``-th window batch."""

    def __init__(self, teacher: LlamaForCausalLM, text: Iterator[torch.Tensor], prefix_len: int, seed: int,
                 greedy_fraction: float = 0.0):
        self.teacher, self.text, self.prefix_len = teacher, text, prefix_len
        self.generator = torch.Generator().manual_seed(seed)
        self.greedy_period = round(1 / greedy_fraction) if greedy_fraction > 0 else 0
        self.count = 0

    def __iter__(self) -> "TargetSamples":
        return self

    @torch.no_grad()
    def __next__(self) -> torch.Tensor:
        windows = next(self.text)
        self.count += 1
        greedy = bool(self.greedy_period) and self.count % self.greedy_period == 0
        batch, width = windows.shape
        cache = self.teacher.new_cache(batch, width)
        tokens = windows[:, :self.prefix_len]
        logits = self.teacher.forward(tokens, cache, last_only=True)[:, -1]  # (B, V)
        columns = [tokens]
        for step in range(width - self.prefix_len):
            for row in range(batch):
                cache.commit(row, columns[-1].shape[1])
            if greedy:
                columns.append(logits.argmax(dim=-1, keepdim=True))  # (B, 1)
            else:
                probs = torch.softmax(logits.float(), dim=-1)
                columns.append(torch.multinomial(probs, 1, generator=self.generator))
            if step < width - self.prefix_len - 1:
                logits = self.teacher.forward(columns[-1], cache)[:, -1]
        return torch.cat(columns, dim=1)


class MixedBatches:
    """Text micro-batches with every ``round(1 / fraction)``-th one replaced by target samples."""

    def __init__(self, text: Iterator[torch.Tensor], samples: Iterator[torch.Tensor], fraction: float):
        self.text, self.samples = text, samples
        self.period = round(1 / fraction) if fraction > 0 else 0
        self.count = 0

    def __iter__(self) -> "MixedBatches":
        return self

    def __next__(self) -> torch.Tensor:
        self.count += 1
        if self.period and self.count % self.period == 0:
            return next(self.samples)
        return next(self.text)
