"""verispec.roofline: the bytes a decode step reads and the bandwidth bound they give."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from verispec.models.llama import load_checkpoint


def test_roofline_counts_the_weights_a_step_reads(checkpoints):
    from verispec.profile import roofline, weight_bytes_per_token

    model = load_checkpoint(checkpoints["llama"], kernels=False)
    config = model.config
    layers = {id(p): p for name, p in model.named_parameters() if p.dim() == 2 and "embed" not in name}
    expected = sum(p.numel() * 4 for p in layers.values())  # fp32 linears (a tied head counted once)
    expected += sum(p.numel() * 4 for p in model.parameters() if p.dim() == 1)  # norms
    expected += config.hidden_size * 4  # one embedding row
    if config.tie_word_embeddings:
        expected += config.vocab_size * config.hidden_size * 4  # the head is the embedding matrix
    assert weight_bytes_per_token(model) == expected
    data = roofline(model, decode_ms=1.0, context=8)
    assert data["bandwidth_gb_s"] > 0.1 and data["roofline_ms"] > 0
    assert data["decode_over_roofline"] == pytest.approx(1.0 / data["roofline_ms"])


def test_weights_are_counted_as_stored_and_shared_ones_once():
    """A bf16 linear counts 2 bytes a weight, a packed copy replaces the weight it packs, a linear sharing
    another's weight is not counted again, an embedding is one row, a norm its vector."""
    from verispec.roofline import weight_bytes_per_token

    first, shared, packed = nn.Linear(8, 4, bias=False), nn.Linear(8, 4, bias=False), nn.Linear(8, 16, bias=False)
    shared.weight = first.weight
    first.to(torch.bfloat16)
    packed.packed = torch.zeros(10, dtype=torch.int8)
    norm = nn.LayerNorm(8)
    model = nn.Sequential(nn.Embedding(100, 8), first, shared, packed, norm)
    assert weight_bytes_per_token(model) == 8 * 4 + 32 * 2 + 10 + 8 * 4


def test_measured_bandwidth_is_a_positive_rate():
    from verispec.roofline import measure_bandwidth_gb_s

    assert 0.05 < measure_bandwidth_gb_s(megabytes=4, repeats=2) < 10_000
