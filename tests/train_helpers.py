"""Small models and batches shared by the training tests (tests/test_train*.py)."""

from __future__ import annotations

import torch

from verispec.models.llama import LlamaConfig, LlamaForCausalLM
from verispec.train.target import init_weights


def tiny(layers=3, hidden=32, seed=0, std=0.02):
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=hidden, intermediate_size=64,
                                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                         tie_word_embeddings=True))
    init_weights(model, std)
    return model


def repeating_batch():
    pattern = torch.tensor([3, 7, 11, 19, 23, 5, 9, 13])
    return pattern.repeat(4, 5)[:, :33]  # (B, T + 1)
