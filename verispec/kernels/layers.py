"""The model-facing side of the kernel: ``SmallRowsLinear`` (an nn.Linear whose few-row inference calls
use the kernel), grouped projections read in one call (``Group``, ``projections``, ``joined_projection``),
and ``accelerate`` / ``quantize``, which switch a model's layers over and ``gather`` their packed weights
into one block of memory. Re-exported by ``verispec.kernels``;
names of the package are read from it at call time (``_k``), so a test that patches ``verispec.kernels.X``
patches what this module calls."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from verispec import kernels as _k
from verispec.kernels.formats import FORMATS, GGUF_DTYPES
from verispec.kernels.packing import Arena


class SmallRowsLinear(nn.Linear):
    """An nn.Linear (same parameters and state dict) whose few-row inference calls use the kernel.
    Made by ``accelerate``, which sets ``packed`` (``_pack_weight``): the layer's GGUF rows when a loader
    gave it ``gguf_blocks`` = (format name, uint8 (N, row bytes)) that hold exactly its weight, else the
    weight as bf16 when that is exact, else fp32. ``quantize`` adds ``quantized`` (``quantize_int8``),
    used for the passes its format takes (``rows_for``)."""

    packed: torch.Tensor
    packed_version: int
    group: "Group | None" = None
    quantized: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _k._few_rows(x, self.in_features, self.weight, limit=_k.rows_for(self.packed)):
            if self.weight._version != self.packed_version:  # weights edited in place since packing
                self._pack()
            weight = _k.weight_for_rows(self.packed, self.quantized, x.numel() // self.in_features)
            return _k.linear(x, weight, self.bias)
        return F.linear(x, self.weight, self.bias)

    def _pack(self) -> None:
        self.packed = _k._pack_weight(self.weight, getattr(self, "gguf_blocks", None))
        self.packed_version, self.group = self.weight._version, None
        if self.quantized is not None:
            self.quantized = _k.quantize_int8(self.weight)


class Group:
    """Linear layers that read the same input (q/k/v, gate/up), packed as one matrix whose row blocks
    are the members' own packed weights (views, no extra memory): one kernel call computes them all."""

    def __init__(self, layers: tuple[SmallRowsLinear, ...], cat=torch.cat):
        """``cat``: how the members' weights are joined (``Arena.cat`` places them in a block)."""
        self.layers = layers
        self.packed = cat([layer.packed for layer in layers])
        self.quantized = None  # int8 rows of every member, when ``quantize`` gave each its own
        if all(layer.quantized is not None for layer in layers):
            self.quantized = cat([layer.quantized for layer in layers])
        biases = [layer.bias for layer in layers]
        self.bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])
        self.bias_versions = [None if b is None else b._version for b in biases]
        self.sizes = [layer.out_features for layer in layers]
        offset = 0
        for layer, size in zip(layers, self.sizes):
            layer.packed, layer.group = self.packed[offset:offset + size], self
            if self.quantized is not None:
                layer.quantized = self.quantized[offset:offset + size]
            offset += size

    @staticmethod
    def compatible(layers) -> bool:
        return (all(isinstance(layer, SmallRowsLinear) for layer in layers)
                and len({(layer.in_features, layer.packed.dtype, layer.bias is None) for layer in layers}) == 1)

    def current(self) -> bool:
        """No member was repacked or had its weight or bias edited in place since grouping."""
        return all(layer.group is self and layer.weight._version == layer.packed_version
                   and (layer.bias is None or layer.bias._version == version)
                   for layer, version in zip(self.layers, self.bias_versions))


def _ready_group(x: torch.Tensor, layers: tuple[nn.Module, ...]) -> "Group | None":
    """The group ``accelerate`` made of exactly ``layers``, if the kernel applies to ``x`` and the
    group's packed weights are current."""
    group = getattr(layers[0], "group", None)
    if group is not None and group.layers == layers and group.current() \
            and _k._few_rows(x, layers[0].in_features, layers[0].weight, limit=_k.rows_for(group.packed)):
        return group
    return None


def projections(x: torch.Tensor, *layers: nn.Module) -> tuple[torch.Tensor, ...]:
    """``tuple(layer(x) for layer in layers)``, in one kernel call when ``accelerate`` grouped them."""
    group = _ready_group(x, layers)
    if group is not None:
        weight = _k.weight_for_rows(group.packed, group.quantized, x.numel() // layers[0].in_features)
        return _k.linear(x, weight, group.bias).split(group.sizes, dim=-1)
    return tuple(layer(x) for layer in layers)


def joined_projection(x: torch.Tensor, *layers: nn.Module) -> torch.Tensor:
    """``torch.cat([layer(x) for layer in layers], -1)``, in one kernel call (no copy) when grouped."""
    group = _ready_group(x, layers)
    if group is not None:
        weight = _k.weight_for_rows(group.packed, group.quantized, x.numel() // layers[0].in_features)
        return _k.linear(x, weight, group.bias)
    return torch.cat([layer(x) for layer in layers], dim=-1)


def first_rows(layer: SmallRowsLinear, size: int) -> SmallRowsLinear | None:
    """A layer of ``layer``'s first ``size`` output rows sharing its packed (and int8) weights: views,
    nothing packed or checked again (the GGUF rows' check at load covered these rows). None where a
    layout's row blocks do not end at ``size`` (AMX tiles of 16 rows), the layer has a bias or its packing
    is stale; the caller then packs a new layer itself."""
    packed, quantized = layer.packed, layer.quantized
    multiples = [FORMATS[packed.dtype].rows_multiple] + ([] if quantized is None else
                                                             [FORMATS[quantized.dtype].rows_multiple])
    if layer.bias is not None or layer.weight._version != layer.packed_version or any(size % m for m in multiples):
        return None
    rows = nn.Linear(layer.in_features, size, bias=False, device="meta")
    rows.weight = nn.Parameter(layer.weight.detach()[:size], requires_grad=False)
    rows.__class__ = SmallRowsLinear
    rows.packed, rows.packed_version = packed[:size], rows.weight._version
    rows.quantized = None if quantized is None else quantized[:size]
    return rows


GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # read through projections()


def accelerate(model: nn.Module) -> int:
    """Switch every eligible nn.Linear of ``model`` (fp32 on the CPU, in_features % 8 == 0) to the kernel
    for few-row calls and group the projections of GROUPS; returns how many layers were switched (0
    when the kernel is unavailable)."""
    if _k.library() is None:
        return 0
    switched = 0
    for module in model.modules():
        if (type(module) is nn.Linear and module.weight.dtype == torch.float32 and not module.weight.is_cuda
                and module.in_features % 8 == 0
                and (module.bias is None or module.bias.dtype == torch.float32)):
            module.__class__ = SmallRowsLinear
            module._pack()
            switched += 1
    with torch.no_grad():
        for module in model.modules():
            for names in GROUPS:
                layers = tuple(getattr(module, name, None) for name in names)
                if Group.compatible(layers):
                    Group(layers)
    gather(model)
    return switched


def quantize(model: nn.Module) -> int:
    """Give every kernel linear layer of ``model`` (see ``accelerate``) int8 rows (``quantize_int8``),
    used for passes of up to INT8_ROWS rows, and regroup; returns how many layers got them. Layers on
    GGUF blocks keep them (already 4.5 or 8.5 bits a weight, and the file's own values). For draft
    models only: a draft's weights decide what it proposes and so the acceptance, never the committed
    distribution, which the target alone defines. At one row a pass is bound by reading the weights:
    int8 rows are half of bf16's bytes."""
    layers = [m for m in model.modules() if isinstance(m, SmallRowsLinear)]
    with torch.no_grad():
        for layer in layers:
            on_blocks = layer.packed.dtype in GGUF_DTYPES
            layer.quantized = None if on_blocks else _k.quantize_int8(layer.weight)
            layer.group = None
        for module in model.modules():
            module.__dict__.pop("_fused_weights", None)
            for names in GROUPS:
                members = tuple(getattr(module, name, None) for name in names)
                if Group.compatible(members):
                    Group(members)
    gather(model)
    return sum(layer.quantized is not None for layer in layers)


def gather(model: nn.Module) -> int:
    """Move the packed (and int8) weights of ``model``'s kernel layers into one ``Arena``, in module order
    (a pass's reading order): 2 MiB aligned, on transparent huge pages where Linux grants them. Each
    layer's weights were separate allocations on 4 KiB pages; in one block of huge pages SmolLM2's
    passes of 1, 3 and 8 rows took ~3% less time on the Xeon (``experiments/weight_arena.py``). Groups are made
    anew over the block, and single layers get new tensors, so every plan holding the old pointers
    (``LayerWeights``, ``LayerPlan``, ``PassArgs``) sees that it is stale and is rebuilt. The same values:
    outputs do not change. Returns the bytes gathered (0: no kernel layers, or ``GATHER`` off)."""
    if not _k.GATHER:
        return 0
    owners: list = []  # Groups and ungrouped layers, each once, in module order
    seen: set[int] = set()
    for module in model.modules():
        if isinstance(module, SmallRowsLinear):
            owner = module.group if module.group is not None and module.group.current() else module
            if id(owner) not in seen:
                seen.add(id(owner))
                owners.append(owner)
    if not owners:
        return 0
    sizes = 0
    for owner in owners:
        members = owner.layers if isinstance(owner, Group) else (owner,)
        sizes += Arena.size([m.packed for m in members])
        if all(m.quantized is not None for m in members):
            sizes += Arena.size([m.quantized for m in members])
    arena = Arena(sizes)
    with torch.no_grad():
        for owner in owners:
            if isinstance(owner, Group):
                Group(owner.layers, cat=arena.cat)
                continue
            if owner.group is not None:  # a stale group: the layer leaves it (``forward`` reads its own)
                owner.group = None
            owner.packed = arena.cat([owner.packed])
            if owner.quantized is not None:
                owner.quantized = arena.cat([owner.quantized])
        for module in model.modules():
            module.__dict__.pop("_fused_weights", None)
            module.__dict__.pop("_layer_plans", None)
    return sizes
