"""A decoder whose attention history is compressed along the sequence (CSA/HCA-like), with the
per-branch scratch pads and accepted-path refresh that speculation on it needs.

Each layer's query at position t attends to three kinds of entries:

- raw KV of the last ``window`` positions (t - window + 1 .. t), RoPE at their positions;
- one CSA entry per *complete* block of ``block`` (m) tokens ending at or before t: a learned projection
  of the block's concatenated layer inputs (normed hidden states), its key rotated to the block's last
  position;
- optionally one HCA entry per complete block of ``hca_block`` (M) tokens: a projection of the block's
  mean layer input.

Worked example, m = 4, committed length 6 (positions 0..5): CSA row 0 (block 0..3) is committed; the
open partial block holds positions 4, 5. A tree verified next puts two siblings at position 6 and
grandchildren at position 7: each grandchild completes block 4..7 from *its own* branch's tokens, so the
two branches own two different rows, and a node sees only the rows of its own root-to-node path. A tree
mask over raw KV alone cannot express this (``scratch_pads=False`` builds that naive model; tests show it
diverges from plain decoding).

State (``CompressedState``) per layer: raw keys/values and layer inputs by position, committed CSA/HCA
rows, and the running input sum of the open HCA block. A forward pass writes nothing committed: its
nodes' raw KV and inputs go to the slots after the committed length (scratch, never attended by a later
pass), and each node's newly completed rows live in the pass's ``Scratch``, visible to its descendants
only. ``commit`` / ``compact`` then *refresh* the accepted path: compact its raw KV and inputs (skipped
when the path already sits in place, as in a chain), append its completed rows, rebuild the open HCA sum.
The full per-position history is kept (a deployment would keep a ring of ``window`` raw entries) so that
``set_length`` can roll back to any prefix, which the draft-model protocol needs.

Shape letters as in docs/architecture.md; C hidden size, T new nodes (flattened tree), Nb / Nh new CSA / HCA rows.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from verispec.errors import CheckpointError, ContextError
from verispec.kernels import accelerate
from verispec.models.llama import MLP, RMSNorm, load_state
from verispec.models.protocol import Capabilities
from verispec.models.rope import apply_rotary, inverse_frequencies, rotary_tables

MODEL_TYPE = "verispec_compressed"


@dataclass(frozen=True)
class CompressedConfig:
    vocab_size: int
    hidden_size: int = 256
    intermediate_size: int = 768
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    window: int = 16  # raw positions a query sees, itself included
    block: int = 4  # CSA: tokens merged into one entry
    hca_block: int = 0  # HCA: tokens merged into one entry; 0 = no HCA level
    max_position_embeddings: int = 1024
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = True
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    model_type: str = MODEL_TYPE
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self):
        if self.block < 1 or self.window < 1 or self.hca_block < 0:
            raise CheckpointError(f"compressed model needs block >= 1, window >= 1, hca_block >= 0 "
                                  f"(got {self.block}, {self.window}, {self.hca_block})")
        if self.hidden_size % self.num_attention_heads or self.num_attention_heads % self.num_key_value_heads:
            raise CheckpointError("hidden_size must divide by num_attention_heads, and heads by key/value heads")

    # The names the engine and loaders read on any target.
    @property
    def kv_heads(self) -> int:
        return self.num_key_value_heads

    @property
    def dim_per_head(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def max_context(self) -> int:
        return self.max_position_embeddings

    @property
    def eos_ids(self) -> list[int]:
        if self.eos_token_id is None:
            return []
        return list(self.eos_token_id) if isinstance(self.eos_token_id, list) else [self.eos_token_id]

    def to_dict(self) -> dict:
        out = asdict(self)
        out.pop("extra")
        out["architectures"] = ["VerispecCompressedForCausalLM"]
        return out

    @classmethod
    def from_dict(cls, raw: dict) -> "CompressedConfig":
        if raw.get("model_type") != MODEL_TYPE:
            raise CheckpointError(f"model_type {raw.get('model_type')!r} is not {MODEL_TYPE!r}")
        names = set(cls.__dataclass_fields__) - {"extra"}
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "window", "block", "hca_block", "max_position_embeddings"):
            value, least = raw.get(key, 1), 0 if key == "hca_block" else 1
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                kind = "non-negative" if least == 0 else "positive"
                raise CheckpointError(f"config.json: {key} must be a {kind} integer, got {value!r}")
        try:
            return cls(**{k: v for k, v in raw.items() if k in names})
        except TypeError as err:
            raise CheckpointError(f"compressed-model config.json is incomplete: {err}") from None


# ---- state ----------------------------------------------------------------------------------------------

@dataclass
class Scratch:
    """What one forward pass computed but did not commit: per-node scratch pads."""

    base: int  # committed length when the pass ran
    positions: list[int]  # (T,) position of each new node
    parents: list[int]  # within the pass; -1 = child of the committed prefix
    csa_nodes: list[int]  # nodes whose position completes a CSA block, one new row each
    csa_keys: torch.Tensor  # (L, Hkv, Nb, D), keys already rotated
    csa_values: torch.Tensor
    hca_nodes: list[int]
    hca_keys: torch.Tensor  # (L, Hkv, Nh, D)
    hca_values: torch.Tensor


class CompressedState:
    """One sequence's committed compressed state; the cache-shaped object the engine drives.

    The engine protocol of ``KVCache`` holds: ``lengths``, ``check_room``, ``commit(row, n)`` (the first n
    nodes of the last pass, a chain, become committed), ``compact(row, slots)`` (a tree's accepted path,
    given as absolute slots ``base + node``), ``set_length`` (roll back), ``reset``. Only one row."""

    def __init__(self, config: CompressedConfig, max_len: int, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu"):
        layers, kv_heads, head_dim = config.num_hidden_layers, config.kv_heads, config.dim_per_head
        self.config, self.max_len = config, max_len
        self.keys = torch.zeros(layers, kv_heads, max_len, head_dim, dtype=dtype, device=device)  # (L, Hkv, S, D)
        self.values = torch.zeros_like(self.keys)
        self.inputs = torch.zeros(layers, max_len, config.hidden_size, dtype=dtype, device=device)  # (L, S, C)
        self.csa_keys = torch.zeros(layers, kv_heads, max_len // config.block + 1, head_dim, dtype=dtype,
                                    device=device)
        self.csa_values = torch.zeros_like(self.csa_keys)
        hca_rows = max_len // config.hca_block + 1 if config.hca_block else 0
        self.hca_keys = torch.zeros(layers, kv_heads, hca_rows, head_dim, dtype=dtype, device=device)
        self.hca_values = torch.zeros_like(self.hca_keys)
        self.hca_sum = torch.zeros(layers, config.hidden_size, dtype=torch.float32, device=device)  # open HCA block
        self.length = 0
        self.pending: Scratch | None = None
        self.refresh_count = 0  # refreshes run
        self.materialised_count = 0  # of those, paths already in place (no raw KV moved)

    @property
    def lengths(self) -> list[int]:
        return [self.length]

    @property
    def batch(self) -> int:
        return 1

    @property
    def csa_rows(self) -> int:
        return self.length // self.config.block

    @property
    def hca_rows(self) -> int:
        return self.length // self.config.hca_block if self.config.hca_block else 0

    def check_room(self, num_new: int) -> None:
        if self.length + num_new > self.max_len:
            raise ContextError(f"sequence would reach {self.length + num_new} positions but the state holds "
                               f"{self.max_len}; shorten the prompt or lower max_tokens")

    def reset(self) -> None:
        self.length, self.pending = 0, None
        self.hca_sum.zero_()

    def commit(self, row: int, num_new: int) -> None:
        """The first ``num_new`` nodes of the last pass (a causal chain from its first node) are accepted."""
        self.refresh(list(range(num_new)))

    def compact(self, row: int, source_slots: list[int]) -> None:
        """Keep the tree path at absolute ``source_slots`` (``base + node``, root first)."""
        self.refresh([slot - self.length for slot in source_slots])

    def refresh(self, path: list[int]) -> None:
        """Make the pass's nodes ``path`` (root-to-node order) the committed continuation: their raw KV and
        inputs move to positions base.., their completed CSA/HCA rows are appended, the open HCA sum is
        rebuilt. Everything else the pass computed is dropped."""
        scratch, base = self.pending, self.length
        if not path:
            self.pending = None
            return
        if scratch is None or scratch.base != base:
            raise RuntimeError("refresh without a forward pass over the current committed state")
        for depth, node in enumerate(path):
            expected_parent = path[depth - 1] if depth else -1
            if scratch.positions[node] != base + depth or scratch.parents[node] != expected_parent:
                raise RuntimeError(f"nodes {path} are not a root-to-node path of the last pass")
        self.refresh_count += 1
        if path == list(range(len(path))):
            self.materialised_count += 1  # raw KV and inputs already sit at their positions
        else:
            source = torch.tensor(path, device=self.keys.device) + base
            end = base + len(path)
            self.keys[:, :, base:end] = self.keys[:, :, source]
            self.values[:, :, base:end] = self.values[:, :, source]
            self.inputs[:, base:end] = self.inputs[:, source]
        on_path = set(path)
        self._append_rows(scratch.csa_nodes, on_path, scratch.csa_keys, scratch.csa_values,
                          self.csa_keys, self.csa_values, self.config.block)
        if self.config.hca_block:
            self._append_rows(scratch.hca_nodes, on_path, scratch.hca_keys, scratch.hca_values,
                              self.hca_keys, self.hca_values, self.config.hca_block)
        self.length = base + len(path)
        self._rebuild_hca_sum(base)
        self.pending = None

    def set_length(self, row: int, length: int) -> None:
        """Roll back to the first ``length`` committed positions (rows of blocks that end later go)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"a compressed state rolls back only: length {length} outside [0, {self.length}]")
        self.length, self.pending = length, None
        self._rebuild_hca_sum(None)

    def _append_rows(self, nodes, on_path, new_keys, new_values, keys, values, block: int) -> None:
        # Blocks the committed sequence gains; a correct pass has exactly one row per block on the path
        # (the naive tree-mask-only model may have more or fewer, and commits whatever it has).
        first_row = self.length // block
        gained = (self.length + len(on_path)) // block - first_row
        picked = [i for i, node in enumerate(nodes) if node in on_path][:gained]
        if picked:  # path nodes complete blocks in position order, so their rows are contiguous
            index = torch.tensor(picked, device=keys.device)
            keys[:, :, first_row:first_row + len(picked)] = new_keys[:, :, index]
            values[:, :, first_row:first_row + len(picked)] = new_values[:, :, index]

    def _rebuild_hca_sum(self, previous_length: int | None) -> None:
        """Sum of the layer inputs of the open HCA block; incremental when no block closed since
        ``previous_length``."""
        size = self.config.hca_block
        if not size:
            return
        start = self.length - self.length % size
        if previous_length is not None and start <= previous_length:
            self.hca_sum += self.inputs[:, previous_length:self.length].float().sum(1)
        else:
            self.hca_sum = self.inputs[:, start:self.length].float().sum(1)


# ---- the model ------------------------------------------------------------------------------------------

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


class CompressedLayer(nn.Module):
    def __init__(self, config: CompressedConfig):
        super().__init__()
        self.self_attn = CompressedAttention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CompressedBackbone(nn.Module):
    def __init__(self, config: CompressedConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(CompressedLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


@dataclass(frozen=True)
class _PassPlan:
    """Layer-independent bookkeeping of one inference pass: which node completes which block and who
    sees what. Built once per pass, used by every layer."""

    positions: torch.Tensor  # (T,) true positions (RoPE, window)
    parents: list[int]
    csa_nodes: list[int]
    csa_gather: torch.Tensor  # (Nb, m) indices into [committed tail inputs ; new inputs]
    csa_positions: torch.Tensor  # (Nb,) where each new CSA key is rotated
    hca_nodes: list[int]
    hca_weights: torch.Tensor  # (Nh, T) 1 for the new nodes inside each new HCA block
    hca_uses_open_sum: torch.Tensor  # (Nh,) whether the block started before the pass
    hca_positions: torch.Tensor
    tail: int  # committed inputs prepended to the CSA gather source
    raw_start: int  # first committed raw slot any node's window reaches
    mask: torch.Tensor  # (T, S_total) bool over [raw committed, raw new, csa old, csa new, hca old, hca new]


class CompressedForCausalLM(nn.Module):
    """Inference contract as ``LlamaForCausalLM.forward``: T new tokens after the committed state, a
    causal chain by default or a tree through ``tree_mask`` (T, T) and ``depths`` (T,)."""

    batched_cache = False  # new_cache holds one sequence; batch scoring goes through train_forward
    capabilities = Capabilities(trees=True)

    def __init__(self, config: CompressedConfig, scratch_pads: bool = True):
        super().__init__()
        self.config = config
        self.scratch_pads = scratch_pads  # False: the naive tree-mask-only model the tests must catch
        self.model = CompressedBackbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        frequencies, self.attention_factor = inverse_frequencies(
            config.dim_per_head, {"rope_theta": config.rope_theta}, config.max_position_embeddings)
        self.register_buffer("rope_frequencies", frequencies, persistent=False)
        self._tables: tuple[torch.Tensor, torch.Tensor] | None = None

    def new_cache(self, batch: int = 1, max_len: int | None = None) -> CompressedState:
        if batch != 1:
            raise ContextError("the compressed-attention model decodes one sequence at a time (batch 1); "
                               "it cannot back the batched server yet")
        weight = self.lm_head.weight
        return CompressedState(self.config, max_len or self.config.max_context, weight.dtype, weight.device)

    # ---- inference -------------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, cache: CompressedState, tree_mask: torch.Tensor | None = None,
                depths: torch.Tensor | None = None, last_only: bool = False, **unsupported) -> torch.Tensor:
        """Logits (1, T, V). Writes the nodes' raw KV and inputs after the committed length (uncommitted)
        and leaves their new compressed rows in ``cache.pending`` for ``commit`` / ``compact``."""
        if unsupported:
            raise ContextError(f"the compressed-attention model does not support {sorted(unsupported)} "
                               "(early exit and staged tree drafting need the Llama model)")
        if tokens.shape[0] != 1:
            raise ContextError("the compressed-attention model takes one sequence per forward pass")
        num_new = tokens.shape[1]
        cache.check_room(num_new)
        plan = self._plan(cache, num_new, tree_mask, depths)
        base, config = cache.length, self.config
        cos, sin = self._rotary(plan.positions)
        csa_cos, csa_sin = self._rotary(plan.csa_positions)
        hca_cos, hca_sin = self._rotary(plan.hca_positions)
        x = self.model.embed_tokens(tokens.to(self.lm_head.weight.device))  # (1, T, C)
        layers, kv_heads, head_dim = config.num_hidden_layers, config.kv_heads, config.dim_per_head
        dtype, device = cache.keys.dtype, cache.keys.device
        new_csa = torch.zeros(2, layers, kv_heads, len(plan.csa_nodes), head_dim, dtype=dtype, device=device)
        new_hca = torch.zeros(2, layers, kv_heads, len(plan.hca_nodes), head_dim, dtype=dtype, device=device)
        end = base + num_new
        for index, layer in enumerate(self.model.layers):
            attn = layer.self_attn
            normed = layer.input_layernorm(x)
            cache.inputs[index, base:end] = normed[0]
            q, k, v = attn.project(normed)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
            cache.keys[index, :, base:end], cache.values[index, :, base:end] = k[0], v[0]
            # This pass's CSA rows: each completing node's block, gathered along its own path.
            source = cache.inputs[index, base - plan.tail:end]  # (tail + T, C)
            csa_k, csa_v = attn.entries(attn.csa_proj, source[plan.csa_gather].flatten(1)[None])
            csa_k = apply_rotary(csa_k, csa_cos, csa_sin)
            new_csa[0, index], new_csa[1, index] = csa_k[0], csa_v[0]
            parts_k = [cache.keys[index, :, plan.raw_start:end], cache.csa_keys[index, :, :cache.csa_rows], csa_k[0]]
            parts_v = [cache.values[index, :, plan.raw_start:end], cache.csa_values[index, :, :cache.csa_rows],
                       csa_v[0]]
            if config.hca_block:
                sums = plan.hca_weights.to(dtype) @ normed[0]  # (Nh, C)
                sums = sums + plan.hca_uses_open_sum[:, None] * cache.hca_sum[index].to(dtype)
                hca_k, hca_v = attn.entries(attn.hca_proj, (sums / config.hca_block)[None])
                hca_k = apply_rotary(hca_k, hca_cos, hca_sin)
                new_hca[0, index], new_hca[1, index] = hca_k[0], hca_v[0]
                parts_k += [cache.hca_keys[index, :, :cache.hca_rows], hca_k[0]]
                parts_v += [cache.hca_values[index, :, :cache.hca_rows], hca_v[0]]
            attended = attn.attend(q, torch.cat(parts_k, 1)[None], torch.cat(parts_v, 1)[None], plan.mask)
            x = x + attended
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        cache.pending = Scratch(base, plan.positions.tolist(), plan.parents, plan.csa_nodes, new_csa[0],
                                new_csa[1], plan.hca_nodes, new_hca[0], new_hca[1])
        hidden = x[:, -1:] if last_only else x
        return self.lm_head(self.model.norm(hidden))

    def _plan(self, cache: CompressedState, num_new: int, tree_mask, depths) -> _PassPlan:
        config, base, device = self.config, cache.length, cache.keys.device
        if tree_mask is None:
            ancestors = torch.ones(num_new, num_new, dtype=torch.bool).tril()
            depths = torch.arange(num_new)
        else:
            ancestors = tree_mask.cpu().bool()
            depths = torch.arange(num_new) if depths is None else depths.cpu().long()
        positions = base + depths
        parents = _parents(ancestors)
        # Compression follows each node's own path; the naive model follows the flattened order instead.
        if self.scratch_pads:
            block_ancestors, block_positions, block_parents = ancestors, positions, parents
        else:
            block_ancestors = torch.ones(num_new, num_new, dtype=torch.bool).tril()
            block_positions, block_parents = base + torch.arange(num_new), list(range(-1, num_new - 1))
        m, tail = config.block, min(base, config.block - 1)
        csa_nodes = [j for j in range(num_new) if (int(block_positions[j]) + 1) % m == 0]
        gather = []
        for node in csa_nodes:
            chain, current = [], node
            for _ in range(m):  # walk back m positions: along the path, then into the committed tail
                if current >= 0:
                    chain.append(tail + current)
                    current = block_parents[current]
                else:  # committed position p sits at index p - (base - tail) of the gather source
                    chain.append(int(block_positions[node]) - len(chain) - base + tail)
            gather.append(chain[::-1])
        csa_gather = torch.tensor(gather, dtype=torch.long).view(len(csa_nodes), m)
        size = config.hca_block
        hca_nodes = [j for j in range(num_new) if size and (int(block_positions[j]) + 1) % size == 0]
        hca_weights = torch.zeros(len(hca_nodes), num_new)
        hca_open = torch.zeros(len(hca_nodes))
        for row, node in enumerate(hca_nodes):
            start = int(block_positions[node]) - size + 1
            hca_weights[row] = (block_ancestors[node] & (block_positions >= start)).float()
            hca_open[row] = float(start < base)
        # Visibility, one column group per key kind (see the module docstring).
        raw_start = max(0, int(positions.min()) - config.window + 1)
        committed = torch.arange(raw_start, base)
        lowest = positions[:, None] - config.window + 1
        groups = [committed[None, :] >= lowest,
                  ancestors & (positions[None, :] >= lowest),
                  torch.ones(num_new, cache.csa_rows, dtype=torch.bool),
                  block_ancestors[:, csa_nodes]]
        if size:
            groups += [torch.ones(num_new, cache.hca_rows, dtype=torch.bool), block_ancestors[:, hca_nodes]]
        return _PassPlan(
            positions=positions.to(device), parents=parents, csa_nodes=csa_nodes, csa_gather=csa_gather.to(device),
            csa_positions=block_positions[csa_nodes].to(device), hca_nodes=hca_nodes,
            hca_weights=hca_weights.to(device), hca_uses_open_sum=hca_open.to(device),
            hca_positions=block_positions[hca_nodes].to(device), tail=tail, raw_start=raw_start,
            mask=torch.cat(groups, 1).to(device))

    def _rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        needed = int(positions.max()) + 1 if positions.numel() else 1
        if self._tables is None or self._tables[0].shape[0] < needed or self._tables[0].device != positions.device:
            size = max(needed, self.config.max_position_embeddings)
            self._tables = rotary_tables(self.rope_frequencies, self.attention_factor, size,
                                         self.lm_head.weight.dtype, positions.device)
        cos, sin = self._tables
        return cos[positions][None, None], sin[positions][None, None]  # (1, 1, T, D)

    # ---- training / full-sequence scoring: the same attention, vectorised over whole sequences -----

    def train_forward(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """Causal logits (B, T, V) for whole sequences starting at position 0 (training, and the slow
        reference the incremental pass is tested against), plus an empty dict of exit hidden states (the
        Llama model's signature: this model has no early exits)."""
        config = self.config
        batch, length = input_ids.shape
        device = input_ids.device
        positions = torch.arange(length, device=device)
        cos, sin = self._rotary(positions)
        m, size = config.block, config.hca_block
        csa_ends = torch.arange(m - 1, length, m, device=device)  # (Nb,)
        csa_cos, csa_sin = self._rotary(csa_ends)
        raw = (positions[None, :] <= positions[:, None]) & (positions[None, :] > positions[:, None] - config.window)
        groups = [raw, csa_ends[None, :] <= positions[:, None]]
        if size:
            hca_ends = torch.arange(size - 1, length, size, device=device)
            hca_cos, hca_sin = self._rotary(hca_ends)
            groups.append(hca_ends[None, :] <= positions[:, None])
        mask = torch.cat(groups, 1)
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            attn = layer.self_attn
            normed = layer.input_layernorm(x)
            q, k, v = attn.project(normed)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
            blocks = normed[:, :len(csa_ends) * m].reshape(batch, len(csa_ends), m * config.hidden_size)
            csa_k, csa_v = attn.entries(attn.csa_proj, blocks)
            keys, values = [k, apply_rotary(csa_k, csa_cos, csa_sin)], [v, csa_v]
            if size:
                count = len(hca_ends)
                means = normed[:, :count * size].reshape(batch, count, size, config.hidden_size).float().sum(2).to(normed.dtype)
                hca_k, hca_v = attn.entries(attn.hca_proj, means / size)
                keys.append(apply_rotary(hca_k, hca_cos, hca_sin))
                values.append(hca_v)
            x = x + attn.attend(q, torch.cat(keys, 2), torch.cat(values, 2), mask)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.lm_head(self.model.norm(x)), {}


def _parents(ancestors: torch.Tensor) -> list[int]:
    """Each node's parent within the pass (-1 for first-level nodes). Parents precede children, so a
    node's parent is its highest-numbered strict ancestor."""
    num_new = ancestors.shape[0]
    strict = ancestors & ~torch.eye(num_new, dtype=torch.bool)
    index = torch.where(strict, torch.arange(num_new), torch.full((num_new, num_new), -1))
    return index.max(1).values.tolist() if num_new else []


# ---- checkpoints ----------------------------------------------------------------------------------------

def save_checkpoint(model: CompressedForCausalLM, out_dir: str | Path, dtype: torch.dtype = torch.bfloat16) -> None:
    """config.json (model_type verispec_compressed) + model.safetensors."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    raw = model.config.to_dict()
    raw["torch_dtype"] = str(dtype).removeprefix("torch.")
    (out_dir / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    state = {name: t.detach().to(dtype).contiguous() for name, t in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})


def load_checkpoint(path: str | Path, device: str = "cpu", dtype: torch.dtype = torch.float32,
                    kernels: bool = True) -> CompressedForCausalLM:
    from safetensors.torch import load_file

    path = Path(path)
    try:
        config = CompressedConfig.from_dict(json.loads((path / "config.json").read_text()))
    except (OSError, json.JSONDecodeError) as err:
        raise CheckpointError(f"cannot read {path / 'config.json'}: {err}") from None
    weights = path / "model.safetensors"
    if not weights.is_file():
        raise CheckpointError(f"{str(path)!r} has no model.safetensors")
    try:
        state = load_file(str(weights))
    except Exception as err:  # safetensors raises several types for truncated files
        raise CheckpointError(f"cannot read {weights}: {err}") from None
    with torch.inference_mode(False):  # ordinary parameters even when the caller is in inference mode
        try:
            model = CompressedForCausalLM(config)
        except (TypeError, ValueError, RuntimeError, ZeroDivisionError) as err:  # sizes torch cannot build
            raise CheckpointError(f"{path / 'config.json'} does not describe a model: {type(err).__name__}: "
                                  f"{(str(err).strip().splitlines() or [''])[0]}") from None
        missing, unexpected = load_state(model, state, path)
        missing = [n for n in missing if not (config.tie_word_embeddings and n == "lm_head.weight")]
        if missing or unexpected:
            raise CheckpointError(f"weights in {str(path)!r} do not match its config.json: missing "
                                  f"{missing[:3]}, unexpected {unexpected[:3]}")
        model = model.to(device=device, dtype=dtype).eval()
        if kernels:  # few-row CPU inference through verispec.kernels (no-op on GPUs or where unavailable)
            accelerate(model)
    return model
