"""models/llama_layers.py: the attention mask of a pass (exact small cases), RMSNorm against its formula,
and attention over a KV cache agreeing with plain causal attention over the whole sequence."""

import torch

from verispec.cache import KVCache
from verispec.models.llama_config import LlamaConfig
from verispec.models.llama_layers import Attention, Backbone, RMSNorm, attention_mask
from verispec.models.rope import inverse_frequencies, rotary_tables


def test_one_new_token_after_a_shared_prefix_needs_no_mask():
    assert attention_mask([3], 0, 1, 4, None, "cpu") is None
    assert attention_mask([3, 3], 0, 1, 4, None, "cpu") is None
    assert attention_mask([3, 1], 0, 1, 4, None, "cpu") is not None  # rows of different lengths


def test_mask_of_rows_with_different_bases():
    # Row 0 has 2 committed slots, row 1 has 1; each adds 2 new tokens, causal among themselves.
    mask = attention_mask([2, 1], 0, 2, 4, None, "cpu")
    assert mask.shape == (2, 1, 2, 4)
    assert mask[0, 0].int().tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]
    assert mask[1, 0].int().tolist() == [[1, 1, 0, 0], [1, 1, 1, 0]]  # slot 3: padding past row 1's pass


def test_mask_of_a_tree_after_staged_nodes():
    # One staged node (slot 1) and two new siblings (slots 2, 3) under it, after one committed slot.
    tree = torch.tensor([[True, True, False], [True, False, True]])  # (T, staged + T)
    mask = attention_mask([1], 1, 2, 4, tree, "cpu")
    assert mask[0, 0].int().tolist() == [[1, 1, 1, 0], [1, 1, 0, 1]]


def test_rms_norm_equals_its_formula_in_float32_and_bfloat16():
    norm = RMSNorm(16, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 2.0, 16))
    x = torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(0)) * 4
    want = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight
    with torch.no_grad():
        torch.testing.assert_close(norm(x), want, rtol=1e-5, atol=1e-5)
        half = norm.to(torch.bfloat16)(x.to(torch.bfloat16))
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(half.float(), want, rtol=2e-2, atol=2e-2)


def test_attention_over_a_cache_equals_causal_attention_over_the_whole_sequence():
    config = LlamaConfig(vocab_size=16, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    attention = Attention(config).eval()
    assert (attention.heads, attention.kv_heads, attention.head_dim) == (4, 2, 8)
    frequencies, factor = inverse_frequencies(8, config.rope_dict(), 64)
    cos, sin = rotary_tables(frequencies, factor, 7, torch.float32, "cpu")  # (T, D)
    cos, sin = cos[None, :, None], sin[None, :, None]  # (B, T, 1, D)
    x = torch.randn(1, 7, 32)
    cache = KVCache(1, 1, 16, 2, 8)
    with torch.no_grad():
        whole = attention(x, cos, sin, None, 0, None, 7)
        pieces = []
        for start, end in ((0, 4), (4, 5), (5, 7)):  # a prefill, one decode step, a pass of two
            mask = attention_mask(cache.lengths, 0, end - start, end, None, "cpu")
            pieces.append(attention(x[:, start:end], cos[:, start:end], sin[:, start:end], cache, 0, mask, end))
            cache.commit(0, end - start)
    torch.testing.assert_close(torch.cat(pieces, dim=1), whole, rtol=1e-5, atol=1e-5)


def test_backbone_has_hf_parameter_names():
    config = LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=12, num_hidden_layers=2,
                         num_attention_heads=2)
    names = set(Backbone(config).state_dict())
    assert {"embed_tokens.weight", "norm.weight", "layers.1.self_attn.q_proj.weight",
            "layers.1.mlp.gate_proj.weight", "layers.0.post_attention_layernorm.weight"} <= names
    assert len([name for name in names if name.startswith("layers.0.")]) == 9
