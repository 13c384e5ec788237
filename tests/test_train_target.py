"""Target training's building blocks: the weight init, a seeded fresh model, the run dir and summaries."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from verispec.models.llama import LlamaConfig, LlamaForCausalLM
from verispec.train.loop import TrainHistory
from verispec.train.recipes import OptimConfig
from verispec.train.target import fresh_model, history_summary, init_weights, make_run_dir


def small_config() -> LlamaConfig:
    return LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)


def test_init_weights_scales_residual_projections_and_resets_norms():
    torch.manual_seed(0)
    model = LlamaForCausalLM(small_config())
    init_weights(model, std=0.1)
    weights = dict(model.named_parameters())
    residual = 0.1 / (2 * 2) ** 0.5  # std / sqrt(2L)
    assert weights["model.layers.0.self_attn.o_proj.weight"].std().item() == pytest.approx(residual, rel=0.1)
    assert weights["model.layers.1.mlp.down_proj.weight"].std().item() == pytest.approx(residual, rel=0.1)
    assert weights["model.layers.0.self_attn.q_proj.weight"].std().item() == pytest.approx(0.1, rel=0.1)
    assert weights["model.embed_tokens.weight"].std().item() == pytest.approx(0.1, rel=0.1)  # not nn.Embedding's 1
    norms = [p for name, p in weights.items() if name.endswith("norm.weight")]
    assert len(norms) == 5 and all(torch.equal(p, torch.ones_like(p)) for p in norms)


def test_fresh_model_is_seeded_by_the_recipe():
    def recipe(seed):
        return SimpleNamespace(model=small_config(), optim=OptimConfig(seed=seed), init_std=0.02)

    first, again, other = (fresh_model(LlamaForCausalLM, recipe(seed)).state_dict() for seed in (3, 3, 4))
    assert all(torch.equal(first[name], again[name]) for name in first)
    assert not torch.equal(first["model.layers.0.mlp.up_proj.weight"], other["model.layers.0.mlp.up_proj.weight"])


def test_run_dir_is_created_and_the_summary_rounds_its_figures(tmp_path):
    run_dir = make_run_dir(str(tmp_path / "runs" / "target"))
    assert run_dir.is_dir() and make_run_dir(run_dir) == run_dir  # an existing dir is fine
    history = TrainHistory(planned_steps=12, steps_done=10, tokens_seen=5000, train_seconds=2.04)
    assert history_summary(history) == {"steps": 10, "planned_steps": 12, "tokens_seen": 5000,
                                        "train_seconds": 2.0, "tokens_per_second": 2451.0}
