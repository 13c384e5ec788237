"""The training recipes: each default defined once, consistent with the tokenizer and the docstrings."""

from __future__ import annotations

import dataclasses

import pytest

from verispec.models.llama import LlamaForCausalLM, parameter_count
from verispec.train import tokenizer
from verispec.train.chat_format import EOS_TOKEN, SPECIAL_TOKENS
from verispec.train.recipes import (
    EOS_TOKEN_ID,
    VOCAB_SIZE,
    DraftRecipe,
    OptimConfig,
    TargetRecipe,
    draft_model_config,
    target_model_config,
)
from verispec.train.token_stream import DEFAULT_MIX


def test_recipe_defaults_and_the_documented_model_sizes():
    recipe = TargetRecipe()
    assert (recipe.model.hidden_size, recipe.model.num_hidden_layers, recipe.optim.tokens_per_step) == (384, 8, 8192)
    assert OptimConfig(seq_len=128, micro_batch=4, accum_steps=3).tokens_per_step == 1536
    assert EOS_TOKEN_ID == SPECIAL_TOKENS.index(EOS_TOKEN) and VOCAB_SIZE == tokenizer.VOCAB_SIZE
    for config in (target_model_config(), draft_model_config()):
        assert config.vocab_size == VOCAB_SIZE and config.eos_token_id == config.bos_token_id == EOS_TOKEN_ID
    assert parameter_count(LlamaForCausalLM(target_model_config())) == 15_735_168  # "~15.7M"
    assert parameter_count(LlamaForCausalLM(draft_model_config())) == 3_917_568  # "~3.9M"


def test_recipes_are_frozen_and_each_gets_its_own_mix():
    target, draft = TargetRecipe(), DraftRecipe()
    assert target.mix == DEFAULT_MIX and target.mix is not DEFAULT_MIX and target.mix is not TargetRecipe().mix
    assert draft.optim.seed == 1 != target.optim.seed
    with pytest.raises(dataclasses.FrozenInstanceError):
        target.init_std = 0.1  # type: ignore[misc]
