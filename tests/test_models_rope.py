"""models/rope.py: rotation frequencies per rope_type against transformers' own, the rotation itself."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig as HFLlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from verispec.errors import CheckpointError
from verispec.models.rope import apply_rotary, inverse_frequencies, rotary_tables


def test_the_docstring_example():
    frequencies, factor = inverse_frequencies(4, {"rope_theta": 10000.0}, 64)
    torch.testing.assert_close(frequencies, torch.tensor([1.0, 0.01], dtype=torch.float64))
    assert factor == 1.0
    halved, _ = inverse_frequencies(4, {"rope_type": "linear", "factor": 2.0}, 64)
    torch.testing.assert_close(halved, torch.tensor([0.5, 0.005], dtype=torch.float64))


@pytest.mark.parametrize("rope", [
    {"rope_type": "linear", "factor": 2.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64, "beta_fast": 16.0,
     "mscale": 1.0, "mscale_all_dim": 0.5},
], ids=["linear", "llama3", "yarn", "yarn-mscale"])
def test_scaled_frequencies_equal_transformers(rope):
    parameters = {"rope_theta": 10000.0, **rope}
    hf = HFLlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=512,
                       rope_parameters=parameters)
    want, want_factor = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf, "cpu")
    got, got_factor = inverse_frequencies(16, parameters, 512)
    torch.testing.assert_close(got, want.double(), rtol=1e-6, atol=1e-7)  # theirs are float32
    assert got_factor == pytest.approx(want_factor)


def test_an_unsupported_rope_type_is_refused_by_name():
    with pytest.raises(CheckpointError, match="rope_type 'longrope' is not supported by the native model "
                                              r"\(supported: default, linear, llama3, yarn\); use the transformers"):
        inverse_frequencies(16, {"rope_type": "longrope"}, 512)


def test_rotation_keeps_norms_and_scores_depend_only_on_the_offset():
    frequencies, _ = inverse_frequencies(8, {"rope_theta": 100.0}, 64)
    cos, sin = rotary_tables(frequencies, 1.0, 20, torch.float64, "cpu")  # (20, 8)
    assert torch.equal(cos[0], torch.ones(8, dtype=torch.float64)) and torch.equal(sin[0], torch.zeros(8, dtype=torch.float64))
    generator = torch.Generator().manual_seed(0)
    q, k = torch.randn(8, generator=generator, dtype=torch.float64), torch.randn(8, generator=generator, dtype=torch.float64)

    def rotated(x, position):
        return apply_rotary(x, cos[position], sin[position])
    # Pair (i, i + 4) turns by position * frequency[i], counter-clockwise.
    angle = 7 * frequencies
    turned = torch.cat([q[:4] * angle.cos() - q[4:] * angle.sin(), q[4:] * angle.cos() + q[:4] * angle.sin()])
    torch.testing.assert_close(rotated(q, 7), turned)
    assert torch.allclose(rotated(q, 7).norm(), q.norm())
    assert torch.allclose(rotated(q, 0), q)
    score = rotated(q, 9) @ rotated(k, 4)  # offset 5
    assert torch.allclose(rotated(q, 15) @ rotated(k, 10), score)
    assert not torch.allclose(rotated(q, 15) @ rotated(k, 11), score)


def test_the_attention_factor_scales_the_tables():
    frequencies, _ = inverse_frequencies(8, {}, 64)
    cos, sin = rotary_tables(frequencies, 1.0, 5, torch.float32, "cpu")
    scaled_cos, scaled_sin = rotary_tables(frequencies, 1.5, 5, torch.float32, "cpu")
    torch.testing.assert_close(scaled_cos, 1.5 * cos)
    torch.testing.assert_close(scaled_sin, 1.5 * sin)
    assert cos.shape == (5, 8) and torch.equal(cos[:, :4], cos[:, 4:])  # rotate-half layout
