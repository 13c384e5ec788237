"""A time-budgeted training loop: AdamW, warmup + cosine schedule over a step count planned from speed.

    loop = BudgetedLoop(model, OptimConfig(), minutes=75, on_checkpoint=save_latest)
    history = loop.run(batches, loss_fn)     # loss_fn(tokens (B, T+1), micro_step) -> (loss, scalars)
    history.records[-1]["loss"], history.planned_steps

The loop runs until the time budget is spent, and the cosine decays over that time. The first
``plan_after_steps`` optimizer steps are timed to plan a step count (``planned_steps``, logged); the
first steps are the slowest, so the estimate is renewed at every logged step (``estimated_steps``,
the progress bar's total). Prime ``batches`` before ``run`` so data loading is not timed.
``on_checkpoint(step, history)`` runs every ``checkpoint_every_s`` seconds so an interrupted run
leaves something usable.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from verispec.train.recipes import OptimConfig

logger = logging.getLogger(__name__)

LossFn = Callable[[torch.Tensor, int], tuple[torch.Tensor, dict[str, float]]]


def learning_rate(step: int, planned_steps: int | None, config: OptimConfig, time_fraction: float = 0.0) -> float:
    """Linear warmup to ``lr`` over ``warmup_steps``, then cosine to ``min_lr_ratio * lr`` at the plan's end.

    Progress through the cosine is the larger of the step-based progress and ``time_fraction`` (elapsed /
    budget): if the machine slows down after planning (a shared CPU), the decay still completes in time.
    The training loop passes ``planned_steps=None`` and decays by time alone, since on a shared machine
    the speed measured at the start says little about the rest of the run.

    >>> config = OptimConfig(lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    >>> learning_rate(4, 100, config), learning_rate(10, 100, config), round(learning_rate(100, 100, config), 3)
    (0.5, 1.0, 0.1)
    >>> round(learning_rate(10, 100, config, time_fraction=1.0), 3)
    0.1
    """
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    step_progress = 0.0 if planned_steps is None else \
        (step - config.warmup_steps) / max(planned_steps - config.warmup_steps, 1)
    progress = min(max(step_progress, time_fraction), 1.0)
    floor = config.min_lr_ratio * config.lr
    return floor + (config.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def make_optimizer(model: torch.nn.Module, config: OptimConfig) -> torch.optim.AdamW:
    """AdamW; matrices (and the embedding) decay, norm gains do not."""
    unique = {id(p): p for p in model.parameters() if p.requires_grad}.values()
    decay = [p for p in unique if p.dim() >= 2]
    no_decay = [p for p in unique if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=config.lr, betas=config.betas)


@dataclass
class TrainHistory:
    records: list[dict] = field(default_factory=list)  # one per logged step
    planned_steps: int | None = None  # the steps the budget fits at the first steps' speed
    estimated_steps: int | None = None  # the same at the speed so far (renewed each logged step)
    steps_done: int = 0
    tokens_seen: int = 0
    train_seconds: float = 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_seen / max(self.train_seconds, 1e-9)


class BudgetedLoop:
    def __init__(self, model: torch.nn.Module, config: OptimConfig, minutes: float,
                 on_checkpoint: Callable[[int, TrainHistory], None] | None = None):
        self.model, self.config = model, config
        self.budget_s = minutes * 60.0
        self.optimizer = make_optimizer(model, config)
        self.on_checkpoint = on_checkpoint

    def _plan(self, history: TrainHistory, elapsed: float) -> int:
        per_step = elapsed / history.steps_done
        return history.steps_done + max(int((self.budget_s - elapsed) / per_step), 0)

    def _optimizer_step(self, batches: Iterator[torch.Tensor], loss_fn: LossFn, step: int,
                        time_fraction: float) -> dict[str, float]:
        config = self.config
        lr = learning_rate(step, None, config, time_fraction)  # decay by wall time; the plan is an estimate
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        sums: dict[str, float] = {}
        counts: dict[str, int] = {}  # a scalar may appear in only some micro-batches (rotating exits)
        for micro in range(config.accum_steps):
            tokens = next(batches)  # outside autocast: a batch source may run a model of its own
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=config.precision == "bf16"):
                loss, scalars = loss_fn(tokens, step * config.accum_steps + micro)
            (loss / config.accum_steps).backward()
            for key, value in {"loss": loss.item(), **scalars}.items():
                sums[key] = sums.get(key, 0.0) + value
                counts[key] = counts.get(key, 0) + 1
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), config.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        means = {key: total / counts[key] for key, total in sums.items()}
        return {**means, "lr": lr, "grad_norm": float(grad_norm)}

    def run(self, batches: Iterator[torch.Tensor], loss_fn: LossFn) -> TrainHistory:
        config, history = self.config, TrainHistory()
        self.model.train()
        start = last_checkpoint = time.monotonic()
        progress = tqdm(desc="train", unit="step", dynamic_ncols=True, mininterval=5.0)
        while True:
            elapsed = time.monotonic() - start
            if elapsed >= self.budget_s:  # the budget is wall time; the step plan only feeds the progress bar
                break
            scalars = self._optimizer_step(batches, loss_fn, history.steps_done, elapsed / self.budget_s)
            history.steps_done += 1
            history.tokens_seen += config.tokens_per_step
            elapsed = history.train_seconds = time.monotonic() - start
            if history.planned_steps is None and history.steps_done >= config.plan_after_steps:
                history.planned_steps = history.estimated_steps = progress.total = self._plan(history, elapsed)
                logger.info("measured %.0f tokens/s over %d steps; planned %d steps in %.0f min",
                            history.tokens_per_second, history.steps_done, history.planned_steps, self.budget_s / 60)
            elif history.planned_steps is not None and history.steps_done % config.log_every == 0:
                history.estimated_steps = progress.total = self._plan(history, elapsed)
            progress.update(1)
            progress.set_postfix(loss=f"{scalars['loss']:.3f}", tok_s=f"{history.tokens_per_second:.0f}")
            if history.steps_done % config.log_every == 0 or history.steps_done == 1:
                record = {"step": history.steps_done, "tokens": history.tokens_seen, "elapsed_s": elapsed,
                          "tokens_per_s": history.tokens_per_second, **scalars}
                history.records.append(record)
                logger.info("step %d  loss %.4f  lr %.2e  %.0f tok/s  %.1f min", history.steps_done,
                            scalars["loss"], scalars["lr"], history.tokens_per_second, elapsed / 60)
            if self.on_checkpoint and time.monotonic() - last_checkpoint >= config.checkpoint_every_s:
                self.on_checkpoint(history.steps_done, history)
                self.model.train()
                # Checkpoint time is not training time; shift the clock so the plan still holds.
                pause = time.monotonic() - (start + history.train_seconds)
                start += pause
                last_checkpoint = time.monotonic()
        progress.close()
        self.model.eval()
        return history
