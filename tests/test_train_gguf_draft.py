"""A draft cut from its target's layers: the restricted distillation loss and evaluation measured on
a draft that is the whole target (so it agrees with the target everywhere)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from train_helpers import repeating_batch, tiny

from verispec.train.gguf_draft import chat_renderer, draft_from_target, evaluate, restricted_distillation_loss


def test_a_draft_of_every_target_layer_matches_it_and_shares_its_embedding():
    target = tiny(layers=2, seed=7, std=0.3)
    draft = draft_from_target(target, (0, 1))
    assert draft.model.embed_tokens.weight is target.model.embed_tokens.weight is draft.lm_head.weight
    assert not draft.model.embed_tokens.weight.requires_grad
    tokens = repeating_batch()
    with torch.no_grad():
        assert torch.allclose(draft.train_forward(tokens)[0], target.train_forward(tokens)[0], atol=1e-6)
        loss, scalars = restricted_distillation_loss(draft, target, tokens, draft_vocab=20, argmax_weight=0.0)
        restricted = F.softmax(target.train_forward(tokens[:, :-1])[0][..., :20], dim=-1)  # (B, T, 20)
    entropy = -(restricted * restricted.log()).sum(-1).mean().item()  # cross-entropy of p with itself
    assert scalars["soft_ce"] == pytest.approx(entropy, rel=1e-5) and loss.item() == pytest.approx(entropy, rel=1e-5)
    assert scalars["greedy_match"] == 1.0 and "argmax_ce" not in scalars
    report = evaluate(draft, target, tokens, draft_vocab=50, micro_batch=3)
    assert report["greedy_match"] == 1.0 and report["positions"] == tokens[:, :-1].numel()
    assert report["expected_acceptance_t1"] == pytest.approx(1.0, abs=1e-5)


def test_a_one_layer_draft_copies_the_layer_it_names():
    target = tiny(layers=3, seed=7, std=0.3)
    draft = draft_from_target(target, (2,))
    assert draft.config.num_hidden_layers == 1
    assert torch.equal(draft.model.layers[0].mlp.up_proj.weight, target.model.layers[2].mlp.up_proj.weight)
    assert draft.model.layers[0].mlp.up_proj.weight is not target.model.layers[2].mlp.up_proj.weight  # a copy


def test_chat_renderer_uses_the_tokenizers_template_or_none():
    class Templated:
        chat_template = "set"

        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            return repr((messages, tokenize, add_generation_prompt))

    class Plain:
        chat_template = None

    assert chat_renderer(Plain()) is None
    render = chat_renderer(Templated())
    assert render((("user", "Hi"),), True) == repr(([{"role": "user", "content": "Hi"}], False, True))
