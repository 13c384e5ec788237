"""Training losses: LayerSkip's schedule and early exits, distillation towards the teacher."""

from __future__ import annotations

import random

import pytest
import torch
from train_helpers import repeating_batch, tiny

from verispec.train.losses import distillation_loss, layerskip_loss
from verispec.train.recipes import LayerSkipConfig


def test_layerskip_loss_learns_and_trains_early_exits():
    model = tiny()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rng, tokens = random.Random(0), repeating_batch()
    config = LayerSkipConfig(max_dropout=0.2, exits_per_micro_batch=2, exit_loss_scale=0.5)
    first = last = None
    for step in range(60):
        loss, scalars = layerskip_loss(model, tokens, config, step, rng)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        first = first if first is not None else scalars
        last = scalars
    assert last["final_loss"] < 0.3 * first["final_loss"]
    assert any(key.startswith("exit") for key in last)


def test_distillation_pulls_the_draft_towards_the_teacher():
    teacher, draft = tiny(seed=1, std=0.3), tiny(layers=1, seed=2)  # a peaked, far-from-uniform teacher
    optimizer = torch.optim.AdamW(draft.parameters(), lr=1e-2)
    tokens = repeating_batch()
    kls = []
    for _ in range(40):
        loss, scalars = distillation_loss(draft, teacher, tokens, ce_weight=0.2)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        kls.append(scalars["kl"])
    assert kls[0] >= 0 and kls[-1] < 0.5 * kls[0]


def test_argmax_term_adds_cross_entropy_on_the_teachers_argmax():
    teacher, draft = tiny(seed=1, std=0.3), tiny(layers=1, seed=2)
    tokens = repeating_batch()
    with torch.no_grad():
        plain, _ = distillation_loss(draft, teacher, tokens, ce_weight=0.2)
        weighted, scalars = distillation_loss(draft, teacher, tokens, ce_weight=0.2, argmax_weight=0.5)
        argmax = teacher.train_forward(tokens[:, :-1])[0].argmax(dim=-1)
        reference = torch.nn.functional.cross_entropy(draft.train_forward(tokens[:, :-1])[0].reshape(-1, 50),
                                                      argmax.reshape(-1))
    assert scalars["argmax_ce"] == pytest.approx(reference.item(), rel=1e-5)
    assert (weighted - plain).item() == pytest.approx(0.5 * reference.item(), rel=1e-4)


def test_layerskip_schedule_rises_rotates_and_weighs_deeper_exits_more():
    from verispec.train.losses import exit_layers_for, exit_loss_weight, layer_dropout_rates, sample_skipped_layers

    assert layer_dropout_rates(3, 0.2) == pytest.approx([0.0, 0.1, 0.2])
    assert layer_dropout_rates(1, 0.2) == [0.0]
    # Exits 1..7 in turn, two per micro-step: every exit is trained within four steps.
    assert [exit_layers_for(step, 8, 2) for step in range(4)] == [[1, 2], [3, 4], [5, 6], [1, 7]]
    assert exit_layers_for(0, 1, 2) == [] and exit_layers_for(0, 8, 0) == []
    assert exit_layers_for(0, 3, 5) == [1, 2]  # more exits asked for than there are: each once
    assert exit_loss_weight(7, 8, 0.5) == 0.5 and exit_loss_weight(1, 8, 0.5) == pytest.approx(0.5 / 7)
    assert sample_skipped_layers([0.0, 1.0, 0.0, 1.0], random.Random(0)) == frozenset({1, 3})
