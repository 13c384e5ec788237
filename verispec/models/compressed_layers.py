"""The layers of the compressed-attention model (``models.compressed``): attention whose keys and values
include learned CSA/HCA block entries, the decoder layer and the backbone."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from verispec.models.compressed_config import CompressedConfig
from verispec.models.llama_layers import Backbone, DecoderLayer

class CompressedAttention(nn.Module):
    def __init__(self, config: CompressedConfig):
        super().__init__()
        heads, kv_heads, head_dim = config.num_attention_heads, config.kv_heads, config.dim_per_head
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
        # One CSA entry's key and value from its block's concatenated inputs (m * C).
        self.csa_proj = nn.Linear(config.block * hidden, 2 * kv_heads * head_dim, bias=False)
        self.hca_proj = nn.Linear(hidden, 2 * kv_heads * head_dim, bias=False) if config.hca_block else None
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q (B, H, T, D), k and v (B, Hkv, T, D), unrotated, from normed inputs x (B, T, C)."""
        batch, num_new, _ = x.shape
        q = self.q_proj(x).view(batch, num_new, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, num_new, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, num_new, self.kv_heads, self.head_dim).transpose(1, 2)
        return q, k, v

    def entries(self, proj: nn.Linear, pooled: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Compressed keys and values (B, Hkv, R, D) from pooled block inputs (B, R, m*C or C)."""
        batch, rows, _ = pooled.shape
        kv = proj(pooled).view(batch, rows, 2, self.kv_heads, self.head_dim)
        return kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)

    def attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """q (B, H, T, D) over keys/values (B, Hkv, S, D) with mask (T, S) or (B, 1, T, S) -> (B, T, C)."""
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
        batch, _, num_new, _ = q.shape
        return self.o_proj(out.transpose(1, 2).reshape(batch, num_new, self.heads * self.head_dim))


class CompressedLayer(DecoderLayer):
    """The decoder layer's parameters (HF names) around compressed attention. ``CompressedForCausalLM``
    runs the parts itself: its attention needs the pass plan and the state, not a ``KVCache``."""

    def __init__(self, config: CompressedConfig):
        super().__init__(config, CompressedAttention)


class CompressedBackbone(Backbone):
    def __init__(self, config: CompressedConfig):
        super().__init__(config, CompressedLayer)
