"""The building blocks of the native Llama-family decoder (``models.llama``): RMSNorm, grouped-query
attention over a ``KVCache``, the SwiGLU MLP, the decoder layer, and the attention mask of a pass."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from verispec import kernels
from verispec.cache import KVCache
from verispec.kernels import joined_projection, projections
from verispec.models.llama_config import LlamaConfig
from verispec.models.rope import apply_rotary

class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # the same formula as below, fused (natively for few rows)
            native = kernels.rms_norm(x, self.weight, self.eps)
            return native if native is not None else F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(variance + self.eps)).to(x.dtype) * self.weight


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        heads, kv_heads, head_dim = config.num_attention_heads, config.kv_heads, config.dim_per_head
        qkv_bias = config.attention_bias or config.qkv_bias
        self.q_proj = nn.Linear(config.hidden_size, heads * head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(config.hidden_size, kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(config.hidden_size, kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(heads * head_dim, config.hidden_size, bias=config.attention_bias)
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache | None,
                layer: int, mask: torch.Tensor | None, num_slots: int) -> torch.Tensor:
        batch, num_new, _ = x.shape
        heads, kv_heads = self.heads, self.kv_heads
        qkv = joined_projection(x, self.q_proj, self.k_proj, self.v_proj)
        qkv = qkv.view(batch, num_new, heads + 2 * kv_heads, self.head_dim)  # (B, T, H + 2 Hkv, D)
        qk = apply_rotary(qkv[:, :, :heads + kv_heads], cos, sin)  # q and k rotated together
        q = qk[:, :, :heads].transpose(1, 2)  # (B, H, T, D)
        k = qk[:, :, heads:].transpose(1, 2)  # (B, Hkv, T, D)
        v = qkv[:, :, heads + kv_heads:].transpose(1, 2)
        if cache is None:  # training / full-sequence scoring: plain causal attention
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            cache.write(layer, k, v)
            k, v = cache.view(layer, num_slots)  # (B, Hkv, S, D)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(batch, num_new, self.heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        bias = config.mlp_bias
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = projections(x, self.gate_proj, self.up_proj)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks, each added to the residual stream. ``attention`` builds the
    attention block from the config (the compressed model passes its own and runs the parts itself)."""

    def __init__(self, config: LlamaConfig, attention: Callable[..., nn.Module] = Attention):
        super().__init__()
        self.self_attn = attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, cos, sin, cache, layer, mask, num_slots):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, layer, mask, num_slots)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    """Embedding, ``layer(config)`` for each of the config's layers, final norm."""

    def __init__(self, config: LlamaConfig, layer: Callable[..., nn.Module] = DecoderLayer):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(layer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


def attention_mask(bases: list[int], staged: int, num_new: int, num_slots: int,
                   tree_mask: torch.Tensor | None, device) -> torch.Tensor | None:
    """Bool mask (B, 1, T, S): slots before each row's base, plus the round's own slots (``staged``
    earlier tree nodes and the T new ones) that the tree mask allows."""
    if tree_mask is None and staged == 0 and num_new == 1 and len(set(bases)) == 1:
        return None  # one new token after a shared prefix sees every slot
    own_size = staged + num_new
    if tree_mask is None:
        tree_mask = torch.ones(num_new, own_size, dtype=torch.bool, device=device).tril(staged)
    bases_t = torch.tensor(bases, device=device)
    relative = torch.arange(num_slots, device=device)[None, :] - bases_t[:, None]  # (B, S)
    committed = relative < 0
    inside = (relative >= 0) & (relative < own_size)
    gather_index = relative.clamp(0, own_size - 1)[:, None, :].expand(len(bases), num_new, num_slots)
    own = tree_mask.expand(len(bases), num_new, own_size).gather(2, gather_index) & inside[:, None, :]
    return (committed[:, None, :] | own)[:, None]  # (B, 1, T, S)
