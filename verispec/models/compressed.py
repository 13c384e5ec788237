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

The config is ``compressed_config``, the state ``compressed_state``, the layers ``compressed_layers``;
their names stay importable from this module.

Shape letters as in docs/architecture.md; C hidden size, T new nodes (flattened tree), Nb / Nh new CSA / HCA rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from verispec.errors import CheckpointError, ContextError
from verispec.kernels import accelerate
from verispec.models.checkpoint_io import (load_all_weights, read_config_json, read_weights, weights_to_load,
                                           write_checkpoint)
from verispec.models.compressed_config import MODEL_TYPE, CompressedConfig
from verispec.models.compressed_layers import CompressedAttention, CompressedBackbone, CompressedLayer
from verispec.models.compressed_state import CompressedState, Scratch
from verispec.models.protocol import Capabilities
from verispec.models.rope import apply_rotary, inverse_frequencies, rotary_tables

__all__ = [
    "MODEL_TYPE", "CompressedAttention", "CompressedBackbone", "CompressedConfig", "CompressedForCausalLM",
    "CompressedLayer", "CompressedState", "Scratch", "load_checkpoint", "save_checkpoint",
]




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
                hca_blocks = normed[:, :count * size].reshape(batch, count, size, config.hidden_size)
                means = hca_blocks.float().sum(2).to(normed.dtype)
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
    write_checkpoint(model, model.config.to_dict(), out_dir, dtype, model.config.tie_word_embeddings)


def load_checkpoint(path: str | Path, device: str = "cpu", dtype: torch.dtype = torch.float32,
                    kernels: bool = True) -> CompressedForCausalLM:
    path = Path(path)
    config = CompressedConfig.from_dict(read_config_json(path))
    weights = path / "model.safetensors"
    if not weights.is_file():
        raise CheckpointError(f"{str(path)!r} has no model.safetensors")
    state = read_weights([weights])
    with torch.inference_mode(False):  # ordinary parameters even when the caller is in inference mode
        try:
            with weights_to_load():
                model = CompressedForCausalLM(config)
        except (TypeError, ValueError, RuntimeError, ZeroDivisionError) as err:  # sizes torch cannot build
            raise CheckpointError(f"{path / 'config.json'} does not describe a model: {type(err).__name__}: "
                                  f"{(str(err).strip().splitlines() or [''])[0]}") from None
        load_all_weights(model, state, path, {"lm_head.weight"} if config.tie_word_embeddings else set())
        model = model.to(device=device, dtype=dtype).eval()
        if kernels:  # few-row CPU inference through verispec.kernels (no-op on GPUs or where unavailable)
            accelerate(model)
    return model
