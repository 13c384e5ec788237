"""Native Llama-family decoder (Llama, Qwen2, Mistral) in plain PyTorch, loading HF checkpoint dirs.

RMSNorm, RoPE (with the scaling variants of ``rope.py``), SwiGLU, grouped-query attention, optional
q/k/v bias (Qwen2) and tied or untied embeddings. Parameter names equal HF's, so a state dict moves
between the two unchanged.

Inference goes through ``forward(tokens, cache, tree_mask=None, depths=None)``: the T new tokens of
each row sit right after its committed cache slots, at positions ``length + depth``. Without a tree mask
the new tokens are a causal chain (depth = index); with one, new token t sees the committed prefix plus
the new tokens j where ``tree_mask[t, j]`` (its ancestors and itself). Example, one row holding 5
committed tokens, verifying a chain [a, x1, x2]: positions 5, 6, 7; x2 attends to slots 0..7.

The model class is here, with checkpoint loading and saving; its config is ``llama_config``, its layers
``llama_layers``, and the names of both stay importable from this module.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch
from torch import nn

from verispec import kernels
from verispec.cache import KVCache
from verispec.errors import CheckpointError
from verispec.kernels import accelerate
from verispec.models.checkpoint_io import (load_all_weights, load_state, read_config_json, read_weights,
                                           weights_to_load, write_checkpoint)
from verispec.models.llama_config import (
    ARCHITECTURES, OPTIONAL_SIZES, REQUIRED_SIZES, LlamaConfig, check_config_values)
from verispec.models.llama_layers import MLP, Attention, Backbone, DecoderLayer, RMSNorm, attention_mask
from verispec.models.protocol import Capabilities
from verispec.models.rope import inverse_frequencies, rotary_tables

__all__ = [
    "ARCHITECTURES", "OPTIONAL_SIZES", "REQUIRED_SIZES", "Attention", "Backbone", "DecoderLayer", "LlamaConfig",
    "LlamaForCausalLM", "MLP", "RMSNorm", "attention_mask", "check_config_values", "load_checkpoint",
    "load_state", "parameter_count", "save_checkpoint",
]

_attention_mask = attention_mask  # the name models.hf imports


class LlamaForCausalLM(nn.Module):
    """The model; see the module docstring for the inference contract."""

    capabilities = Capabilities(trees=True, staged_trees=True, early_exit=True, features=True, vocab_limit=True,
                                batching=True)

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.model = Backbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        frequencies, self.attention_factor = inverse_frequencies(
            config.dim_per_head, config.rope_dict(), config.max_position_embeddings)
        self.register_buffer("rope_frequencies", frequencies, persistent=False)
        self._tables: tuple[torch.Tensor, torch.Tensor] | None = None
        # (last_only, vocab limit) -> the one-call pass's prepared arguments (``_one_call``)
        self._pass_args: dict[tuple, kernels.PassArgs] = {}

    # ---- inference -------------------------------------------------------------------------------

    def new_cache(self, batch: int = 1, max_len: int | None = None) -> KVCache:
        config = self.config
        weight = self.lm_head.weight
        return KVCache(config.num_hidden_layers, batch, max_len or config.max_context, config.kv_heads,
                       config.dim_per_head, dtype=weight.dtype, device=weight.device)

    def forward(self, tokens: torch.Tensor, cache: KVCache, tree_mask: torch.Tensor | None = None,
                depths: torch.Tensor | None = None, last_only: bool = False,
                num_layers: int | None = None, staged: int = 0, vocab_limit: int | None = None,
                with_features: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Logits (B, T, V) for T new tokens (B, T) placed after each row's committed slots.

        tree_mask: (T, T) or (B, T, T) bool, new token t may see new token j; default causal. With
        ``staged`` > 0 the last ``staged`` committed slots are tree nodes of the current round (drafted
        level by level) and tree_mask is (T, staged + T): which of those and of the new tokens each new
        token sees. depths: (T,) or (B, T) offsets of the new tokens' positions from the row's length
        minus ``staged``; default staged..staged+T-1. last_only: return only the last position's
        logits (prefill). num_layers: run only the first E layers, then the final norm and LM head
        (early-exit drafting). vocab_limit: logits only for ids < N, the rest -inf (``logits``).
        with_features: also return every new token's final-normed hidden state (B, T, H), the vector
        the LM head reads (what a feature drafter such as ``models.eagle`` drafts from): the same
        pass, the same logits.
        """
        if tokens.shape[0] == 1 and tree_mask is None and depths is None and not staged \
                and (num_layers is None or num_layers == self.config.num_hidden_layers):
            out = self._one_call(tokens, cache, last_only, vocab_limit, with_features)
            if out is not None:
                return out
        return self._steps(tokens, cache, tree_mask, depths, last_only, num_layers, staged, vocab_limit,
                           with_features)

    @torch.inference_mode()
    def _steps(self, tokens: torch.Tensor, cache: KVCache, tree_mask: torch.Tensor | None, depths: torch.Tensor | None,
               last_only: bool, num_layers: int | None, staged: int, vocab_limit: int | None,
               with_features: bool = False):
        """``forward`` piece by piece: embedding, ``run_layers``, final norm and head."""
        stop = self.config.num_hidden_layers if num_layers is None else num_layers
        tokens = tokens.to(self.lm_head.weight.device)  # callers build ids on the CPU
        hidden = self.run_layers(self.model.embed_tokens(tokens), cache, 0, stop, tree_mask, depths, staged)
        if not with_features:
            return self.logits(hidden[:, -1:] if last_only else hidden, vocab_limit)
        features = self.model.norm(hidden)
        return self.head_logits(features[:, -1:] if last_only else features, vocab_limit), features

    def _one_call(self, tokens: torch.Tensor, cache: KVCache, last_only: bool,
                  vocab_limit: int | None, with_features: bool = False):
        """One row's whole pass as one native call (``kernels.model_pass``: embedding, every layer,
        final norm, LM head), the same arithmetic as the steps without their Python dispatch, with its
        fixed arguments prepared once (``kernels.PassArgs``, rebuilt when anything it was built from
        changed): both the per-step dispatch and the per-call argument assembly are saved, which makes
        draft and target steps faster than piece by piece (experiments/draft_step_pieces.py measures
        the whole call, the pieces and the bare native call). None where a step would not take the
        kernel (then the caller runs the steps)."""
        num_new = tokens.shape[1]
        if not kernels.FUSED_LAYERS or tokens.dtype != torch.long or tokens.is_cuda or num_new > kernels.max_fused():
            return None
        limited = vocab_limit is not None and vocab_limit < self.config.vocab_size
        head = self._limited_head(vocab_limit) if limited else self.lm_head
        inner = self.model
        embedding, norm = inner.embed_tokens.weight, inner.norm
        first = cache.lengths[0]
        if first + num_new > cache.max_len:
            return None  # the steps raise the context error
        tables = self._rotary_tables(first + num_new, embedding.device)
        key = (last_only, vocab_limit if limited else None)
        args = self._pass_args.get(key)
        if args is None or not args.current(embedding, tables, cache, norm, head):
            args = self._prepare_pass(key, embedding, tables, cache, norm, head)
            if args is None:
                return None
        head_args = args.head_for(1 if last_only else num_new)
        if head_args is None:
            return None
        if not with_features:
            return kernels.model_pass(args, cache, tokens.contiguous(), head_args)
        features = torch.empty(1, num_new, self.config.hidden_size, dtype=torch.float32)
        return kernels.model_pass(args, cache, tokens.contiguous(), head_args, features), features

    def _prepare_pass(self, key, embedding, tables, cache, norm, head) -> "kernels.PassArgs | None":
        self._pass_args.pop(key, None)
        if type(head) is not kernels.SmallRowsLinear or head.bias is not None \
                or not kernels.PassArgs.fits(embedding, tables, norm, cache):
            return None
        plan = kernels.LayerPlan.for_layers(self.model.layers, 0, len(self.model.layers))
        if plan is None:
            return None
        args = self._pass_args[key] = kernels.PassArgs(plan, embedding, tables, cache, norm, head,
                                                       self.config.vocab_size, key[0])
        return args

    @torch.inference_mode()
    def run_layers(self, x: torch.Tensor, cache: KVCache, start: int, stop: int,
                   tree_mask: torch.Tensor | None = None, depths: torch.Tensor | None = None,
                   staged: int = 0) -> torch.Tensor:
        """Hidden states (B, T, H) after layers start..stop-1 for inputs x (B, T, H) placed as in
        ``forward``; writes those layers' KV only. Early-exit drafting runs 0..E, and verification
        resumes at E with the drafting pass's exit hidden states."""
        batch, num_new, _ = x.shape
        cache.check_room(num_new)
        rows = kernels.max_fused()
        if batch == 1 and num_new > rows and tree_mask is None and depths is None and not staged \
                and kernels.amx() and kernels.FUSED_LAYERS and kernels.fused_applies(x[:, :rows], cache):
            return self._run_in_chunks(x, cache, start, stop, rows)
        if depths is not None:
            depths = depths.to(x.device)
        if tree_mask is not None:
            tree_mask = tree_mask.to(x.device)
        bases = [length - staged for length in cache.lengths]
        num_slots = max(cache.lengths) + num_new
        fused = kernels.FUSED_LAYERS and kernels.fused_applies(x, cache)
        if fused and batch == 1 and depths is None:  # consecutive positions: rows of the rotary tables
            cos, sin = self._rotary_rows(bases[0] + staged, num_new)  # (T, D)
        else:
            if depths is None:
                depths = torch.arange(staged, staged + num_new, device=x.device)
            positions = torch.tensor(bases, device=x.device)[:, None] + depths.expand(batch, num_new)  # (B, T)
            cos, sin = self._rotary(positions)  # (B, T, D)
        # The native layer is causal by itself (row b's token t sees slots < its own); a mask only
        # for trees and staged nodes. Torch's layer gets the full mask, built once if needed.
        native_mask = None
        if fused:
            x, lengths = x.clone(memory_format=torch.contiguous_format), torch.tensor(cache.lengths)
            cos, sin = cos.contiguous(), sin.contiguous()
            if tree_mask is not None or staged:
                native_mask = attention_mask(bases, staged, num_new, num_slots, tree_mask, x.device).contiguous()
        plan = kernels.LayerPlan.for_layers(self.model.layers, start, stop) if fused else None
        if plan is not None:  # every layer native: one call for all of them
            kernels.decoder_layers(plan, x, cos, sin, cache, start, lengths, native_mask, num_slots)
            return x
        torch_mask: list[torch.Tensor | None] = []  # built on the first layer that takes torch's path
        for index in range(start, stop):
            layer = self.model.layers[index]
            weights = kernels.LayerWeights.for_layer(layer) if fused else None
            if weights is not None:
                kernels.decoder_layer(weights, x, cos, sin, cache, index, lengths, native_mask, num_slots)
                continue
            if not torch_mask:
                torch_mask.append(attention_mask(bases, staged, num_new, num_slots, tree_mask, x.device))
            x = layer(x, *self._broadcast_rotary(cos, sin, batch, num_new), cache, index, torch_mask[0], num_slots)
        return x

    def _run_in_chunks(self, x: torch.Tensor, cache: KVCache, start: int, stop: int, rows: int) -> torch.Tensor:
        """A long causal pass of one row (a prompt) as consecutive fused passes of ``rows`` tokens, each
        committed so the next sees it, and the row's length restored at the end: what a pass leaves
        in the cache is unchanged. Each token's arithmetic is the fused layer's, the same bits as
        decoding it alone. Only where AMX multiplies: there torch's per-op path beyond ``rows`` is
        slower than the fused chunks, while on the AVX2 loop 64-row passes are slower than torch's one
        big pass (experiments/prefill_cost.py measures both)."""
        base, hidden = cache.lengths[0], []
        try:
            for first in range(0, x.shape[1], rows):
                hidden.append(self.run_layers(x[:, first:first + rows], cache, start, stop))
                cache.commit(0, hidden[-1].shape[1])
        finally:
            cache.set_length(0, base)
        return torch.cat(hidden, dim=1)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token ids (B, T), on any device -> embeddings (B, T, H) on the model's device."""
        return self.model.embed_tokens(tokens.to(self.lm_head.weight.device))

    def logits(self, hidden: torch.Tensor, vocab_limit: int | None = None) -> torch.Tensor:
        """Final norm + LM head: (..., H) -> (..., V). With ``vocab_limit`` N < V only ids < N are scored
        and the rest get -inf: a draft that proposes only its N first tokens (by a BPE tokenizer's
        merge order, the most frequent ones) for a fraction of the head's cost. Any draft distribution
        keeps speculative sampling lossless; a target token outside the N is simply never drafted."""
        return self.head_logits(self.model.norm(hidden), vocab_limit)

    def head_logits(self, normed: torch.Tensor, vocab_limit: int | None = None) -> torch.Tensor:
        """``logits`` after the final norm: the LM head (or its first ``vocab_limit`` rows, the rest -inf)
        on final-normed hidden states (..., H)."""
        if vocab_limit is None or vocab_limit >= self.config.vocab_size:
            return self.lm_head(normed)
        part = self._limited_head(vocab_limit)(normed)
        out = part.new_full((*part.shape[:-1], self.config.vocab_size), float("-inf"))
        out[..., :vocab_limit] = part
        return out

    def _limited_head(self, size: int) -> nn.Linear:
        """The LM head's first ``size`` rows as their own linear layer (a view: no copy of fp32 weights),
        packed for the few-row kernel like the head itself."""
        heads = self.__dict__.setdefault("_limited_heads", {})
        head, source = heads.get(size, (None, None))
        packed = getattr(self.lm_head, "packed", None)  # a new tensor when repacked or gathered
        if head is None or head.weight.data_ptr() != self.lm_head.weight.data_ptr() or source is not packed:
            if isinstance(self.lm_head, kernels.SmallRowsLinear):
                head = kernels.first_rows(self.lm_head, size)  # views of its packed rows, checked at load
                if head is not None:
                    heads[size] = (head, packed)
                    return head
            # On the meta device: no random initialisation of a weight replaced at once (~0.2 s of a cold
            # request's first draft round for SmolLM2's 8192-row draft head).
            head = nn.Linear(self.config.hidden_size, size, bias=False, device="meta")
            head.weight = nn.Parameter(self.lm_head.weight.detach()[:size], requires_grad=False)
            blocks = getattr(self.lm_head, "gguf_blocks", None)
            if blocks is not None:  # GGUF rows are the head's rows too: the kernel reads the first ``size``
                head.gguf_blocks = (blocks[0], blocks[1][:size])
            if isinstance(self.lm_head, kernels.SmallRowsLinear):
                kernels.accelerate(head)
                if self.lm_head.quantized is not None:
                    kernels.quantize(head)
            heads[size] = (head, packed)
        return head

    def _rotary_tables(self, needed: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin tables covering positions 0..needed-1, grown on demand by doubling from 1,024
        positions (the whole context at once, 8,192 for SmolLM2, cost ~9 ms at a process's first pass)."""
        if self._tables is None or self._tables[0].shape[0] < needed or self._tables[0].device != device:
            size = max(needed, min(self.config.max_position_embeddings, 1 << max(10, (needed - 1).bit_length())))
            self._tables = rotary_tables(self.rope_frequencies, self.attention_factor, size,
                                         self.lm_head.weight.dtype, device)
        return self._tables

    def _rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin (B, T, D) at positions (B, T)."""
        cos, sin = self._rotary_tables(int(positions.max()) + 1, positions.device)
        return cos[positions], sin[positions]

    def _rotary_rows(self, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin (T, D) at positions first..first+count-1: views of the tables, no gather."""
        cos, sin = self._rotary_tables(first + count, self.lm_head.weight.device)
        return cos[first:first + count], sin[first:first + count]

    @staticmethod
    def _broadcast_rotary(cos: torch.Tensor, sin: torch.Tensor, batch: int, num_new: int):
        """(T, D) or (B, T, D) -> (B, T, 1, D), as torch's attention layer broadcasts them."""
        shape = (batch, num_new, 1, cos.shape[-1])
        return cos.reshape(-1, num_new, 1, cos.shape[-1]).expand(shape), \
            sin.reshape(-1, num_new, 1, sin.shape[-1]).expand(shape)

    # ---- training / full-sequence scoring ---------------------------------------------------------

    def train_forward(self, input_ids: torch.Tensor, skip_layers: frozenset[int] | set[int] = frozenset(),
                      exit_layers: Sequence[int] = ()) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Causal logits (B, T, V) over whole sequences, plus hidden states (before the final norm)
        after ``e`` layers for each e in ``exit_layers``. Layers in ``skip_layers`` are bypassed
        (LayerSkip's layer dropout)."""
        last, hidden = self.train_hidden(input_ids, skip_layers, exit_layers)
        return self.lm_head(self.model.norm(last)), hidden

    def train_hidden(self, input_ids: torch.Tensor, skip_layers: frozenset[int] | set[int] = frozenset(),
                     exit_layers: Sequence[int] = ()) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """``train_forward`` without the final norm and head: the last layer's hidden states (B, T, H)."""
        batch, length = input_ids.shape
        positions = torch.arange(length, device=input_ids.device).expand(batch, length)
        cos, sin = self._broadcast_rotary(*self._rotary(positions), batch, length)
        x = self.model.embed_tokens(input_ids)
        hidden = {}
        for index, layer in enumerate(self.model.layers):
            if index not in skip_layers:
                x = layer(x, cos, sin, None, index, None, length)
            if index + 1 in exit_layers:
                hidden[index + 1] = x
        return x, hidden


# ---- checkpoints ------------------------------------------------------------------------------------

def load_checkpoint(path: str | Path, device: str = "cpu", dtype: torch.dtype = torch.float32,
                    kernels: bool = True, shared_embedding: torch.Tensor | None = None) -> LlamaForCausalLM:
    """Load an HF checkpoint directory (config.json + *.safetensors, sharded or not). With ``kernels``
    its linear layers use verispec.kernels for few-row CPU calls (decode, verification). With
    ``shared_embedding`` (a tied checkpoint saved without its embedding) the model uses that tensor
    itself as its embedding and LM head."""
    path = Path(path)
    config = LlamaConfig.from_hf_dict(read_config_json(path))
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{str(path)!r} holds no *.safetensors weights (PyTorch .bin files are not "
                              "loaded for safety; convert them with transformers' save_pretrained)")
    state = read_weights(files)
    with torch.inference_mode(False):  # ordinary parameters even when the caller is in inference mode
        with weights_to_load():
            model = LlamaForCausalLM(config)
        if config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        may_lack = {"lm_head.weight"} if config.tie_word_embeddings else set()
        if shared_embedding is not None:
            may_lack |= {"lm_head.weight", "model.embed_tokens.weight"}
        load_all_weights(model, state, path, may_lack)
        model = model.to(device=device, dtype=dtype).eval()
        if shared_embedding is not None:
            fits = tuple(shared_embedding.shape) == (config.vocab_size, config.hidden_size)
            if not fits or not config.tie_word_embeddings:
                raise CheckpointError(f"the checkpoint in {str(path)!r} cannot share an embedding of shape "
                                      f"{tuple(shared_embedding.shape)} (it needs a tied "
                                      f"{config.vocab_size} x {config.hidden_size} one)")
            model.model.embed_tokens.weight = shared_embedding
            model.lm_head.weight = shared_embedding
        if kernels:  # few-row CPU inference through verispec.kernels (no-op on GPUs or where unavailable)
            accelerate(model)
    return model


def save_checkpoint(model: LlamaForCausalLM, out_dir: str | Path, dtype: torch.dtype = torch.bfloat16) -> None:
    """Write config.json + model.safetensors that both this loader and transformers load."""
    write_checkpoint(model, model.config.to_hf_dict(), out_dir, dtype, model.config.tie_word_embeddings)


def parameter_count(model: nn.Module) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
