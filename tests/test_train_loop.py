"""The time-budgeted training loop: its schedule, bf16 autocast, and the renewed step estimate."""

from __future__ import annotations

import random

import pytest
import torch
from train_helpers import repeating_batch, tiny

from verispec.train.losses import layerskip_loss
from verispec.train.recipes import LayerSkipConfig


class FakeClock:
    """Stands in for the loop's ``time`` module: seconds pass only when a step says so, so the loop's
    budget, plan and estimate do not depend on how busy the machine is."""

    def __init__(self):
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    from verispec.train import loop

    fake = FakeClock()
    monkeypatch.setattr(loop, "time", fake)
    return fake


def test_bf16_training_runs_under_autocast_learns_and_keeps_float32_state(clock):
    from verispec.train.loop import BudgetedLoop
    from verispec.train.recipes import OptimConfig

    model, tokens, seen = tiny(), repeating_batch(), []

    def loss_fn(batch, micro_step):
        clock.now += 0.03  # 1.8 s of budget: 60 steps
        seen.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))
        loss, scalars = layerskip_loss(model, batch, LayerSkipConfig(max_dropout=0.0), micro_step,
                                       random.Random(0))
        return loss, scalars

    config = OptimConfig(lr=1e-2, warmup_steps=1, accum_steps=1, plan_after_steps=1, log_every=1,
                         precision="bf16")
    history = BudgetedLoop(model, config, minutes=0.03).run(iter(lambda: tokens, None), loss_fn)
    assert history.steps_done >= 20 and set(seen) == {(True, torch.bfloat16)}
    assert history.records[-1]["final_loss"] < 0.3 * history.records[0]["final_loss"]
    assert all(p.dtype == torch.float32 for p in model.parameters())
    seen.clear()
    BudgetedLoop(tiny(), OptimConfig(accum_steps=1, plan_after_steps=1), minutes=0.001).run(
        iter(lambda: tokens, None), loss_fn)
    assert seen and not any(enabled for enabled, _ in seen)  # fp32 (the recipe default) does not autocast


def test_step_estimate_is_renewed_when_the_first_steps_were_slow(clock):
    """The plan from the first steps (slow here: 60 ms of 'warm-up') undershoots; the renewed estimate
    that sizes the progress bar ends near the steps actually run."""
    from verispec.train.loop import BudgetedLoop
    from verispec.train.recipes import OptimConfig

    model, tokens = tiny(), repeating_batch()

    def loss_fn(batch, micro_step):
        clock.now += 0.06 if micro_step < 2 else 0.005
        return layerskip_loss(model, batch, LayerSkipConfig(max_dropout=0.0), micro_step, random.Random(0))

    config = OptimConfig(accum_steps=1, plan_after_steps=2, log_every=1)
    history = BudgetedLoop(model, config, minutes=0.012).run(iter(lambda: tokens, None), loss_fn)
    assert history.planned_steps < 0.6 * history.steps_done
    assert abs(history.estimated_steps - history.steps_done) <= max(2, 0.1 * history.steps_done)


def test_learning_rate_warms_up_then_decays_by_steps_or_time_to_the_floor():
    from verispec.train.loop import learning_rate
    from verispec.train.recipes import OptimConfig

    config = OptimConfig(lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    assert [learning_rate(step, 100, config) for step in (0, 4, 9)] == pytest.approx([0.1, 0.5, 1.0])
    assert learning_rate(10, 100, config) == pytest.approx(1.0)
    assert learning_rate(55, 100, config) == pytest.approx(0.55)  # half way through the cosine
    assert learning_rate(100, 100, config) == pytest.approx(0.1) == learning_rate(500, 100, config)
    assert learning_rate(10, None, config, time_fraction=0.5) == pytest.approx(0.55)  # the loop: by time only
    assert learning_rate(20, 100, config, time_fraction=1.0) == pytest.approx(0.1)


def test_optimizer_decays_matrices_but_not_norm_gains_and_counts_a_tied_weight_once():
    from verispec.train.loop import make_optimizer
    from verispec.train.recipes import OptimConfig

    model = tiny(layers=1)
    decay, no_decay = make_optimizer(model, OptimConfig(weight_decay=0.1)).param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() == 1 for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))
    assert sum(p is model.lm_head.weight for p in decay["params"]) == 1  # tied to the embedding
