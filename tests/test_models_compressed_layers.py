"""models/compressed_layers.py: the compressed attention's projections (CSA entries from a block's
concatenated inputs, HCA entries only where configured), attending with grouped key/value heads against
a written-out softmax, and the HF parameter names of the layers around it."""

import torch

from verispec.models.compressed_config import CompressedConfig
from verispec.models.compressed_layers import CompressedAttention, CompressedBackbone

CONFIG = CompressedConfig(vocab_size=20, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, block=3, hca_block=6)


def test_projection_sizes_and_hca_only_where_configured():
    attention = CompressedAttention(CONFIG)
    assert (attention.heads, attention.kv_heads, attention.head_dim) == (4, 2, 4)
    assert attention.csa_proj.weight.shape == (2 * 2 * 4, 3 * 16)  # keys and values of Hkv heads from m * C
    assert attention.hca_proj.weight.shape == (2 * 2 * 4, 16)
    no_hca = CompressedConfig(vocab_size=20, hidden_size=16, num_attention_heads=4, num_key_value_heads=2, block=3)
    assert CompressedAttention(no_hca).hca_proj is None


def test_project_and_entries_split_heads_in_order():
    torch.manual_seed(0)
    attention = CompressedAttention(CONFIG)
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        q, k, v = attention.project(x)
        assert q.shape == (2, 4, 5, 4) and k.shape == v.shape == (2, 2, 5, 4)
        torch.testing.assert_close(q[1, 2, 3], attention.q_proj(x)[1, 3, 8:12])  # head 2 of position 3
        torch.testing.assert_close(v[0, 1, 4], attention.v_proj(x)[0, 4, 4:8])
        pooled = torch.randn(2, 3, 3 * 16)  # (B, R, m * C)
        keys, values = attention.entries(attention.csa_proj, pooled)
        out = attention.csa_proj(pooled)  # (B, R, 2 * Hkv * D): all keys, then all values
        assert keys.shape == values.shape == (2, 2, 3, 4)
        torch.testing.assert_close(keys[1, 1, 2], out[1, 2, 4:8])
        torch.testing.assert_close(values[1, 0, 2], out[1, 2, 8:12])


def test_attend_equals_a_written_out_grouped_softmax():
    torch.manual_seed(1)
    attention = CompressedAttention(CONFIG)
    q = torch.randn(1, 4, 3, 4)  # (B, H, T, D)
    keys, values = torch.randn(1, 2, 6, 4), torch.randn(1, 2, 6, 4)  # (B, Hkv, S, D)
    mask = torch.rand(3, 6, generator=torch.Generator().manual_seed(2)) < 0.6
    mask[:, 0] = True  # every query sees something
    with torch.no_grad():
        got = attention.attend(q, keys, values, mask)
        shared_k, shared_v = keys.repeat_interleave(2, dim=1), values.repeat_interleave(2, dim=1)  # heads 0,1 -> kv 0
        scores = (q @ shared_k.transpose(-1, -2) / 2.0).masked_fill(~mask, float("-inf"))  # sqrt(D) = 2
        heads = scores.softmax(-1) @ shared_v  # (B, H, T, D)
        want = attention.o_proj(heads.transpose(1, 2).reshape(1, 3, 16))
    assert got.shape == (1, 3, 16)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_backbone_layers_carry_compressed_attention_under_hf_names():
    backbone = CompressedBackbone(CONFIG)
    assert len(backbone.layers) == 2
    assert all(isinstance(layer.self_attn, CompressedAttention) for layer in backbone.layers)
    names = set(backbone.state_dict())
    assert {"embed_tokens.weight", "norm.weight", "layers.1.self_attn.csa_proj.weight",
            "layers.1.self_attn.hca_proj.weight", "layers.0.mlp.down_proj.weight",
            "layers.0.input_layernorm.weight"} <= names
