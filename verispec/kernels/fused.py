"""Whole decoder layers and whole model passes of few rows in one native call (``decoder_layer``,
``decoder_layers``, ``model_pass`` in small_m_linear.c): the per-layer weight pointers (``LayerWeights``),
a plan of many layers (``LayerPlan``), a model pass's fixed arguments (``PassArgs``) and the checks that a
cache and a pass fit them. Re-exported by ``verispec.kernels``; names of the package are read from it at
call time (``_k``), so a test that patches ``verispec.kernels.X`` patches what this module calls."""

from __future__ import annotations

import ctypes

import torch
from torch import nn

from verispec import kernels as _k

class LayerWeights:
    """A decoder layer's weights as ``decoder_layer`` reads them: packed q|k|v and gate|up groups, the
    o and down projections, fp32 norm weights. ``for_layer`` makes one when the layer qualifies and
    remembers it on the layer; ``current`` says whether nothing was edited or repacked since."""

    def __init__(self, layer: nn.Module):
        attention, mlp = layer.self_attn, layer.mlp
        self.layer = layer
        self.qkv, self.gate_up = attention.q_proj.group, mlp.gate_proj.group
        self.o, self.down = attention.o_proj, mlp.down_proj
        self.single = (self.o.packed, self.down.packed)  # held: the pointers below stay valid
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        self.eps = float(norms[0].eps)
        self.shape = (attention.heads, attention.kv_heads, attention.head_dim, mlp.gate_proj.out_features)
        # every tensor whose in-place edit must reach the kernel, with its version now
        self.watched = [t for m in (*self.qkv.layers, *self.gate_up.layers, self.o, self.down, *norms)
                        for t in (m.weight, getattr(m, "bias", None)) if t is not None]
        self.versions = [t._version for t in self.watched]
        self.pointers = self._pointers((self.qkv.packed, self.o.packed, self.gate_up.packed, self.down.packed))
        quantized = (self.qkv.quantized, self.o.quantized, self.gate_up.quantized, self.down.quantized)
        self.single_quantized = quantized[1::2]  # held, as self.single
        # For passes of up to INT8_ROWS rows, when ``quantize`` gave every weight int8 rows.
        self.pointers_int8 = self._pointers(quantized) if all(q is not None for q in quantized) else None

    def _pointers(self, weights: tuple[torch.Tensor, ...]) -> tuple:
        qkv, o, gate_up, down = weights
        norms = (self.layer.input_layernorm, self.layer.post_attention_layernorm)
        flags = 0  # 4 bits per weight, its C weight type (WEIGHT_TYPES)
        for index, packed in enumerate(weights):
            flags |= _k.WEIGHT_TYPES[packed.dtype] << (4 * index)
        pointer = _k._pointer
        return (pointer(norms[0].weight), qkv.data_ptr(), pointer(self.qkv.bias), o.data_ptr(),
                pointer(self.o.bias), pointer(norms[1].weight), gate_up.data_ptr(), pointer(self.gate_up.bias),
                down.data_ptr(), pointer(self.down.bias), flags)

    @staticmethod
    def for_layer(layer: nn.Module) -> "LayerWeights | None":
        weights = getattr(layer, "_fused_weights", None)
        if weights is not None and weights.current():
            return weights
        attention, mlp = layer.self_attn, layer.mlp
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        linears = (attention.q_proj, attention.o_proj, mlp.gate_proj, mlp.down_proj)
        if not (all(isinstance(m, _k.SmallRowsLinear) for m in linears)
                and attention.q_proj.group is not None and mlp.gate_proj.group is not None
                and attention.q_proj.group.layers == (attention.q_proj, attention.k_proj, attention.v_proj)
                and mlp.gate_proj.group.layers == (mlp.gate_proj, mlp.up_proj)
                and attention.q_proj.group.current() and mlp.gate_proj.group.current()
                and all(m.weight._version == m.packed_version for m in (attention.o_proj, mlp.down_proj))
                and all(n.weight.dtype == torch.float32 and n.weight.is_contiguous() for n in norms)
                and norms[0].eps == norms[1].eps and attention.head_dim % 8 == 0
                and attention.heads % attention.kv_heads == 0):
            return None
        weights = LayerWeights(layer)
        layer._fused_weights = weights
        return weights

    def current(self) -> bool:
        """Nothing edited in place, repacked or regrouped since these pointers were taken."""
        attention = self.layer.self_attn
        return ([t._version for t in self.watched] == self.versions
                and attention.q_proj.group is self.qkv and self.layer.mlp.gate_proj.group is self.gate_up
                and all(type(m) is _k.SmallRowsLinear
                        for m in (*self.qkv.layers, *self.gate_up.layers, self.o, self.down))
                and self.o.packed is self.single[0] and self.down.packed is self.single[1]
                and self.o.quantized is self.single_quantized[0] and self.down.quantized is self.single_quantized[1])


class _LayerArgs(ctypes.Structure):
    """``layer_weights`` in the C source: a LayerWeights' pointers, in that order."""
    _fields_ = [(name, ctypes.c_void_p) for name in ("attn_norm", "w_qkv", "b_qkv", "w_o", "b_o", "mlp_norm",
                                                     "w_gu", "b_gu", "w_down", "b_down")] + [("wtypes", ctypes.c_long)]


class LayerPlan:
    """Consecutive decoder layers run by one ``decoder_layers`` call: their LayerWeights (each current,
    all of one shape) and the C arrays of their pointers, packed and (when quantized) int8, so that a
    pass of a few rows does not pay Python's dispatch per layer (weight checks, a 28-argument ctypes
    call)."""

    def __init__(self, weights: list[LayerWeights]):
        self.weights = weights
        self.shape, self.eps = weights[0].shape, weights[0].eps
        # What ``current`` checks, flattened: every LayerWeights.current() condition for all layers,
        # without nn.Module attribute lookups (~1 us each here; 43 us a call for two layers before).
        self.watched = [t for w in weights for t in w.watched]
        self.versions = [t._version for t in self.watched]
        self.members = [(layer, w.qkv) for w in weights for layer in w.qkv.layers]
        self.members += [(layer, w.gate_up) for w in weights for layer in w.gate_up.layers]
        self.singles = [(w.o, w.single[0], w.single_quantized[0]) for w in weights]
        self.singles += [(w.down, w.single[1], w.single_quantized[1]) for w in weights]
        self.array = (_LayerArgs * len(weights))(*[_LayerArgs(*w.pointers) for w in weights])
        self.array_int8, self.rows_int8 = None, 0
        if all(w.pointers_int8 is not None for w in weights):
            self.array_int8 = (_LayerArgs * len(weights))(*[_LayerArgs(*w.pointers_int8) for w in weights])
            self.rows_int8 = _k.rows_for(weights[0].qkv.quantized)

    def current(self) -> bool:
        """Every layer's weights as when planned: nothing edited in place, repacked or regrouped."""
        return ([t._version for t in self.watched] == self.versions
                and all(type(layer) is _k.SmallRowsLinear and layer.group is group for layer, group in self.members)
                and all(type(layer) is _k.SmallRowsLinear and layer.packed is packed and layer.quantized is quantized
                        for layer, packed, quantized in self.singles))

    def array_for(self, rows: int):
        """The C array for a pass of ``rows`` rows: the int8 weights where quantized and within their rows."""
        return self.array_int8 if self.array_int8 is not None and rows <= self.rows_int8 else self.array

    @staticmethod
    def for_layers(layers: nn.ModuleList, start: int, stop: int) -> "LayerPlan | None":
        """The plan for layers start..stop-1, remembered on ``layers``; None where a layer does not
        qualify (``LayerWeights.for_layer``) or the layers differ in shape (callers go layer by layer)."""
        plans = layers.__dict__.setdefault("_layer_plans", {})
        plan = plans.get((start, stop))
        if plan is not None and plan.current():
            return plan
        weights = [LayerWeights.for_layer(layers[index]) for index in range(start, stop)]
        if not weights or any(w is None for w in weights) \
                or len({(w.shape, w.eps, w.pointers_int8 is None) for w in weights}) != 1:
            plans.pop((start, stop), None)
            return None
        plan = plans[(start, stop)] = LayerPlan(weights)
        return plan


def decoder_layers(plan: LayerPlan, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache, start: int,
                   lengths: torch.Tensor, mask: torch.Tensor | None, num_slots: int) -> None:
    """``decoder_layer`` for each of the plan's layers (cache layers start, start + 1, ...) in one call."""
    batch, num_new, hidden = x.shape
    heads, kv_heads, head_dim, intermediate = plan.shape
    array = plan.array_for(batch * num_new)
    keys, values = cache.keys, cache.values
    failed = _k.library().decoder_layers(x.data_ptr(), batch, num_new, hidden, heads, kv_heads, head_dim, intermediate,
                                      plan.eps, ctypes.addressof(array), len(plan.weights), cos.data_ptr(),
                                      sin.data_ptr(), keys[start].data_ptr(), values[start].data_ptr(),
                                      keys.stride(0), cache.max_len, lengths.data_ptr(), num_slots,
                                      None if mask is None else mask.data_ptr(), torch.get_num_threads())
    if failed:
        raise MemoryError(f"a fused decoder layer could not allocate scratch memory for {batch * num_new} rows "
                          f"and {num_slots} slots")


def fused_applies(x: torch.Tensor, cache) -> bool:
    """Whether ``decoder_layer`` can run a pass over x (B, T, H) with this cache: few fp32 CPU rows
    without autograd, a KV cache of fp32 rows laid out (B, Hkv, S, D) per layer, and the library."""
    return _k._few_rows(x, x.shape[-1], limit=_k.max_fused()) and pass_fits(x.shape[-1], cache)


def pass_fits(width: int, cache) -> bool:
    """The pass-independent half of ``fused_applies``: the library, a width of whole 8-value lanes, and
    a cache the native layers can write (``_cache_fits``). The rows and their dtype are the caller's."""
    return (width % 8 == 0 and _k.library() is not None and getattr(cache, "keys", None) is not None
            and _cache_fits(cache))


def _cache_fits(cache) -> bool:
    """The cache's KV tensors are fp32 CPU rows laid out (B, Hkv, S, D) per layer, one stride per layer."""
    keys = cache.keys
    known = cache.__dict__.get("_fused_layout")  # the cache's tensors never change: check their layout once
    if known is not None and known[0] is keys and known[1] is cache.values:
        return known[2]
    layer_keys, layer_values = keys[0], cache.values[0]
    fits = _cache_layout_fits(keys, cache.values, layer_keys, layer_values)
    cache.__dict__["_fused_layout"] = (keys, cache.values, fits)
    return fits


def head_weight(head: nn.Module, rows: int) -> torch.Tensor | None:
    """The weight ``head`` (an LM head) multiplies ``rows`` rows with in its own forward, for
    ``model_pass``: its int8 or packed weight; None where its forward would repack first, add a bias
    or take torch's path."""
    if type(head) is not _k.SmallRowsLinear or head.bias is not None or head.weight._version != head.packed_version:
        return None
    if rows > max(_k.rows_for(head.packed), _k.rows_for(head.quantized) if head.quantized is not None else 0):
        return None
    return _k.weight_for_rows(head.packed, head.quantized, rows)


class PassArgs:
    """What one row's whole pass (``model_pass``) reads that stays put from pass to pass: the plan's
    layers, the embedding table, the rotary tables, the cache's KV tensors, the final norm and the
    head's weights, as the C function's arguments, built once (``LlamaForCausalLM._one_call`` keeps one
    per model, head and kind of pass). Per pass only the tokens, the row's length, the positions'
    rotary rows, the head's weight for that many rows and the logits change. A draft step spent as long
    in Python assembling these (reading ~30 pointers, converting them for ctypes, checking the layout)
    as in the native pass itself (experiments/draft_step_pieces.py: 191 us a step, 88-90 us of it
    native; 125-133 us with the arguments prepared).

    ``current`` says whether the objects it was built from are still the ones the model would use.
    """

    def __init__(self, plan: LayerPlan, embedding: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor], cache,
                 final_norm: nn.Module, head: nn.Module, vocab: int, last_only: bool):
        self.plan, self.embedding, self.tables = plan, embedding, tables
        self.final_norm, self.norm_weight, self.head = final_norm, final_norm.weight, head
        self.packed, self.quantized, self.head_version = head.packed, head.quantized, head.packed_version
        self.vocab, self.last_only = vocab, last_only
        heads, kv_heads, head_dim, intermediate = plan.shape
        cos, sin = tables
        self.positions = cos.shape[0]  # rows of the rotary tables
        self.row_bytes = cos.stride(0) * cos.element_size()
        self.cos, self.sin = cos.data_ptr(), sin.data_ptr()
        self.layers = (embedding.data_ptr(), embedding.shape[0], embedding.shape[1], heads, kv_heads, head_dim,
                       intermediate, plan.eps)
        # The cache by its storage, not by object: an engine's per-round views of one cache share it.
        self.kv = (cache.keys.data_ptr(), cache.values.data_ptr(), cache.keys.stride(0), cache.max_len)
        self.kv_strides = (cache.keys.stride(), cache.values.stride())
        self.lengths = (ctypes.c_long * 1)()  # the row's length, as the C function reads it
        self.lengths_ptr = ctypes.addressof(self.lengths)
        self.norm = (self.norm_weight.data_ptr(), final_norm.eps)
        self.heads: dict[int, tuple | None] = {}  # rows -> (pointer, weight type, head rows), None: too many rows

    @staticmethod
    def fits(embedding: torch.Tensor, tables, final_norm: nn.Module, cache) -> bool:
        """The checks a pass needs once per build: fp32 contiguous embedding, rotary tables and norm, a
        cache the native layers can write (``pass_fits``)."""
        return (embedding.dtype == torch.float32 and not embedding.is_cuda and embedding.is_contiguous()
                and final_norm.weight.dtype == torch.float32 and pass_fits(embedding.shape[1], cache)
                and all(table.dtype == torch.float32 and table.is_contiguous() for table in tables))

    def current(self, embedding: torch.Tensor, tables, cache, final_norm: nn.Module, head: nn.Module) -> bool:
        keys, values = cache.keys, cache.values
        return (embedding is self.embedding and tables is self.tables and keys.data_ptr() == self.kv[0]
                and values.data_ptr() == self.kv[1] and cache.max_len == self.kv[3]
                and (keys.stride(), values.stride()) == self.kv_strides and keys.dtype == torch.float32
                and final_norm is self.final_norm and final_norm.weight is self.norm_weight and head is self.head
                and head.packed is self.packed and head.quantized is self.quantized
                and head.packed_version == self.head_version == head.weight._version and self.plan.current())

    def head_for(self, rows: int) -> tuple | None:
        """(pointer, weight type, rows of the head) of the head's weight for a pass of ``rows`` rows."""
        if rows not in self.heads:
            weight = head_weight(self.head, rows)
            self.heads[rows] = (None if weight is None
                                else (weight.data_ptr(), _k.WEIGHT_TYPES[weight.dtype], weight.shape[0]))
        return self.heads[rows]


def model_pass(args: PassArgs, cache, tokens: torch.Tensor, head: tuple,
               features: torch.Tensor | None = None) -> torch.Tensor:
    """One row's pass in one call (``model_pass`` in the C source): tokens (1, T) contiguous int64 CPU
    ids placed after the row's committed slots in ``cache`` (the one ``args`` is current for), through
    the embedding, the plan's layers, the final norm and the head (``head``: ``args.head_for(rows)``;
    its first head rows ids, the rest of the vocabulary -inf). Logits (1, rows, vocab), rows 1 with ``last_only``, else T. The caller checked
    ``args.current``, the rows (at most ``max_fused()``) and the room in the cache. ``features``: a
    contiguous float32 (1, T, H) tensor that receives every token's final-normed hidden state."""
    num_new = tokens.shape[1]
    rows = 1 if args.last_only else num_new
    logits = torch.empty(1, rows, args.vocab, dtype=torch.float32)
    first = cache.lengths[0]
    args.lengths[0] = first
    offset = first * args.row_bytes
    status = _k.library().model_pass(
        tokens.data_ptr(), num_new, *args.layers, ctypes.addressof(args.plan.array_for(num_new)),
        len(args.plan.weights), args.cos + offset, args.sin + offset, *args.kv, args.lengths_ptr, first + num_new, *args.norm, *head,
        args.vocab, int(args.last_only), logits.data_ptr(), None if features is None else features.data_ptr(),
        torch.get_num_threads())
    if status == 2:
        raise IndexError(f"a token id is outside the embedding's {args.layers[1]} rows")
    if status:
        raise MemoryError(f"a one-call model pass could not allocate scratch memory for {num_new} tokens")
    return logits


def _cache_layout_fits(keys: torch.Tensor, values: torch.Tensor, layer_keys: torch.Tensor,
                       layer_values: torch.Tensor) -> bool:
    return (keys.dtype == torch.float32 and not keys.is_cuda and layer_keys.stride() == layer_values.stride()
            and keys.stride(0) == values.stride(0)
            and layer_keys[0].is_contiguous() and layer_values[0].is_contiguous()
            and layer_keys.stride(0) == layer_keys[0].numel())


def decoder_layer(weights: LayerWeights, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache,
                  layer: int, lengths: torch.Tensor, mask: torch.Tensor | None, num_slots: int) -> None:
    """One decoder layer in place on x (B, T, H) contiguous, as ``DecoderLayer.forward`` computes it
    (within float rounding), writing the layer's new KV at each row's length. cos/sin (B, T, D)
    contiguous, lengths int64 (B,), mask bool (B, 1, T, S) contiguous, or None for causal (each token
    sees its row's slots up to its own). Call only when
    ``fused_applies`` and ``LayerWeights.for_layer`` said yes."""
    batch, num_new, hidden = x.shape
    heads, kv_heads, head_dim, intermediate = weights.shape
    keys, values = cache.keys[layer], cache.values[layer]
    pointers = weights.pointers
    if weights.pointers_int8 is not None and batch * num_new <= _k.rows_for(weights.qkv.quantized):
        pointers = weights.pointers_int8
    failed = _k.library().decoder_layer(x.data_ptr(), batch, num_new, hidden, heads, kv_heads, head_dim,
                                     intermediate, weights.eps, *pointers, cos.data_ptr(), sin.data_ptr(),
                                     keys.data_ptr(), values.data_ptr(), cache.max_len, lengths.data_ptr(),
                                     num_slots, None if mask is None else mask.data_ptr(), torch.get_num_threads())
    if failed:
        raise MemoryError(f"the fused decoder layer could not allocate scratch memory for {batch * num_new} rows "
                          f"and {num_slots} slots")
