"""Native few-row linear kernel for CPU inference (AVX2 + FMA; AVX-512 where the CPU has F/BW/VL/DQ;
AMX tiles where it has AMX-BF16), built on first use.

Decoding multiplies 1 row by every weight matrix and verification K + 1 rows. On AVX2 machines torch's
GEMM costs about twice as much for 8 rows as for 1 although the weights, the dominant memory traffic,
are the same; ``small_m_linear.c`` reads each weight once per call for all rows, and reads bf16
weights directly when a checkpoint's values are bf16 (the fp32 copy is then an exact upcast, so the
products are the same numbers at half the traffic).

    accelerate(model)      # every eligible nn.Linear of model uses the kernel for <= max_rows() rows
    gate, up = projections(x, mlp.gate_proj, mlp.up_proj)   # one call for both
    qkv = joined_projection(x, attn.q_proj, attn.k_proj, attn.v_proj)   # (..., q | k | v)
    # (accelerate, quantize, projections, SmallRowsLinear: layers.py; fused passes: fused.py; weight
    # formats: formats.py; building and loading, self-check: build.py; packing weights: packing.py;
    # all re-exported here)
    status(model)          # "on (57 linear layers, 57 with bf16 weights (...), <= 16 rows; whole decoder
                           #  layers <= 64 rows; avx512: fp32, bf16, int8, Q4_1, Q8_0, Q4_1 pairs (K % 16 == 0, else
                           #  avx2); AMX off: ...)" or why not

The kernel sums every output in the same order whatever the number of rows, so a row's projection is
bit-identical whether it is decoded alone or verified with others. It is compiled with the system C
compiler into ``$VERISPEC_CACHE_DIR`` (default ``~/.cache/verispec``) keyed by the source, the
compiler's path and version and the flags (``library_path``); where that fails (no compiler, no
AVX2/FMA/F16C, not x86-64) or ``VERISPEC_KERNELS=0`` is set, every layer keeps torch's own path and
``status()`` says why. Training never uses it (it has no backward).

``accelerate`` and ``quantize`` end with ``gather``: the model's packed weights in one 2 MiB-aligned block,
in module order, advised as transparent huge pages (``VERISPEC_GATHER=0``: left where packing put them).

Weight formats (``FORMATS`` in ``formats.py``, re-exported here, told by the packed tensor's dtype):
fp32, bf16 (exact for a bf16 checkpoint), AMX tiles, int8 for drafts (``quantize``), and GGUF block rows,
Q4_1 and Q8_0: a loader that sets ``module.gguf_blocks = (format name, uint8 (N, row bytes))`` on an
nn.Linear whose fp32 weight holds those rows' dequantized values, before ``accelerate``, gets the file's
rows multiplied directly (``_pack_blocks``): exactly the dequantized values, at 4.5 or 8.5 bits a weight
read. K-quants are repacked with the same values: Q4_K as Q4_1 pairs with fp32 scales (``q4_k_pairs``, 6
bits a weight), Q6_K as int8 with an fp32 scale per 16 ("Q6_K rows", ``q6_k_rows``, 10 bits); Q4_0 and
Q5_0 as Q8_0 rows (``as_q8_0``). Self-check: loading runs one small product per weight path against
float64 (``_self_check``); a path that disagrees is not packed for (fp32: the library stays off), and
``status()`` says so.

AVX-512: on CPUs with AVX-512 F/BW/VL/DQ the same formats go through a 16-lane loop (``avx512()``;
products of K % 16 == 0, other widths the AVX2 loop), checked at load like the others: a failing
self-check turns it off (the AVX2 loop is then checked alone), as does VERISPEC_AVX512=0; ``status()``
names the loop in use. Each loop keeps rows independent; the two sum in different orders, so their
bits differ by rounding (one process uses one loop for every pass unless ``set_avx512`` switches it).
With it on, a decoder layer's attention also runs on 512-bit registers (two queries, or 16 dimensions,
per register) doing each query's operations exactly as the 8-lane code does: the same bits, 2-15% less
time per SmolLM2 pass on the Xeon (``set_attention_pairs`` switches it; experiments/attention_pairs.py).

AMX: on CPUs with AMX-BF16 (Intel Sapphire Rapids and later; Linux grants the tile state per process)
bf16 weights whose shape is whole 16 x 32 tiles are stored tiled (int16 bit patterns, see
``_pack_weight``) and multiplied with tile instructions, x split exactly into three bf16 parts so the
products are exact and only fp32 accumulation rounds. A pass of 1..16 rows then costs about the same
as one row (``verispec profile`` measures verify(n) / decode(1); docs/results.md). Row results stay
independent of the other rows. VERISPEC_AMX=0
keeps the AVX2 loop; ``status()`` says which path the weights took.

GGUF blocks on AMX (``amx_blocks``; formats "amx-Q4_1" and "amx-Q8_0"): where the CPU has AMX and
AVX512-BF16, a GGUF file's Q4_1 and Q8_0 rows (N % 16 == 0) are tiled too. Their 4- and 8-bit integers
are exact in bf16, so tiles multiply them by x's three exact bf16 parts block by block, and an AVX-512
epilogue applies each block's d (and m times the block's sum of x): the dequantized values, rounded
elsewhere than the AVX-512 loop rounds. A pass then costs about the same for 1 to 16 rows, which makes
verification and batches cheap, while one row (plain decoding of a lone request) costs more than on the
AVX-512 loop (figures: docs/results.md). One process multiplies every pass the same way, so
VERISPEC_AMX_BLOCKS=0 (read when weights are packed) keeps the loops for a process that decodes lone
requests without speculation.

Fused decoder layers (``fused.py``, re-exported here): ``decoder_layer`` runs a whole Llama decoder layer
of a pass of up to ``max_fused()`` rows in one call (the native model's ``run_layers`` uses it where
``fused_applies`` and ``LayerWeights.for_layer`` allow), since at these sizes torch's per-op dispatch
costs more than the arithmetic. Row results are again independent of the other rows in the pass. """

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import torch
from torch import nn

from verispec.kernels.formats import (  # noqa: F401  (re-exported)
    AMX_BLOCKS, BLOCK_FORMATS, FORMATS, GGUF_DTYPES, PAIRS, Q6_K_ROWS, WEIGHT_TYPES, Format, _int8_rows, _int8_values,
    _random_blocks, block_bytes, dequantize_blocks, dequantize_pairs, dequantize_q6_k_rows, packed_inputs,
    as_q8_0, pair_blocks, q4_k_pairs, q6_k_rows)

SOURCE = Path(__file__).with_name("small_m_linear.c")
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC", "-lm"]
MAX_ROWS = 16  # beyond this torch's GEMM is as good on the AVX2 loop (measured: experiments/small_m_kernel.py)
# The AVX-512 loop (Zen 4, one thread) beat torch's fp32 GEMM at every size measured from 20 to 64 rows, whole
# passes of 4 or 8 rows x 5-8 positions: tiny target 8.96 vs 11.08 ms at 20 rows, 25.3 vs 27.7 ms at 64;
# SmolLM2's Q4_1 blocks 73.7 vs 88.1 ms and 279 vs 299 ms (experiments/kernel_rows.py).
MAX_ROWS_AVX512 = 64
# GGUF block rows on the AVX2 loop: from 3 rows three weight rows are dequantized once into a panel and
# multiplied 4 input rows at a time, which beat torch's fp32 GEMM of the dequantized weight up to 64 rows
# (Zen 3 EPYC, one thread, weights in cache: 1536 x 576 at 32 / 64 rows 1.14 / 2.14 vs 1.20 / 2.38 ms,
# 576 x 1536 0.80 / 1.80 vs 0.92 / 1.80, 8192 x 576 4.8 / 9.5 vs 10.1 / 16.2; experiments/blocks_vs_torch.py).
MAX_ROWS_BLOCKS = 64
# On AMX tiles the kernel beats torch's fp32 GEMM far beyond 16 rows: the embedded target's LM head
# (8192 x 384) costs 0.48 vs 1.55 ms at 32 rows and 1.49 vs 4.47 ms at 128 (experiments/amx_linear.py).
# Whole decoder layers in one native call (``decoder_layer``) where the kernel applies; VERISPEC_FUSED_LAYERS=0
# keeps the per-op torch path (layers still use the linear kernel). Read at each pass, so tests and
# experiments may flip it.
FUSED_LAYERS = os.environ.get("VERISPEC_FUSED_LAYERS", "1") != "0"
# ``gather`` puts a model's packed weights in one block of huge pages when it is accelerated or quantized;
# VERISPEC_GATHER=0 leaves each layer's own allocation (read when weights are packed).
GATHER = os.environ.get("VERISPEC_GATHER", "1") != "0"
MAX_FUSED = 64  # rows per fused pass: up to here fused won every shape but one tied (experiments/fused_rows.py)
# With AMX tiles the fused pass won every shape up to 128 rows (0.52-0.89 of the per-op time at 150- and
# 600-token contexts: fused_rows.py --max-fused 128 --shapes 1x1,1x8,16x1,16x4,16x5,32x4,64x2,16x8).
MAX_FUSED_AMX = 128
# Without AMX-INT8, quantized (draft) models use their int8 rows on the AVX2 loop for passes of up to this
# many rows, their bf16 weights beyond. At one row the int8 rows read half the bytes, which makes the
# draft's linears faster than bf16 on the AVX2 loop (experiments/draft_step_pieces.py); with the weights
# in cache the two cost the same at 1-8 rows (the int8 values take extra conversions), so more rows
# gain nothing.
INT8_ROWS = 4

_reason = "not built yet"
_amx_reason = "not built yet"
_avx512_reason = "not built yet"  # "" when the AVX-512 loop multiplies (``avx512``)
AVX512_FLAGS = {"avx512f", "avx512bw", "avx512vl", "avx512dq"}
_failed: dict[str, str] = {}  # weight path (Format.name) -> why the load-time self-check turned it off


def avx512() -> bool:
    """Whether the AVX-512 loop multiplies (``library()`` loaded, the CPU has AVX-512 F/BW/VL/DQ, the
    self-check passed and VERISPEC_AVX512 is not 0) for calls whose K is a multiple of 16; other calls,
    and every call elsewhere, take the AVX2 loop. AMX tiles, where packed, take precedence."""
    return library() is not None and not _avx512_reason


def set_attention_pairs(on: bool) -> bool:
    """Run the attention of two q heads in one 512-bit register (on, the default) or one at a time, for
    later passes; returns whether pairs now run (only with the AVX-512 loop on). The results are
    bit-identical either way, so this is for tests and A/B runs."""
    lib = library()
    return bool(lib is not None and lib.set_attention_pairs(int(on)))


def set_avx512(on: bool) -> bool:
    """Switch the AVX-512 loop on or off for later products (tests and A/B experiments: the packed
    weights are the same for both loops); returns whether it is on. On only where ``avx512()`` allows."""
    lib = library()
    return bool(lib is not None and lib.set_avx512(int(on and not _avx512_reason)))


def max_rows() -> int:
    """Rows up to which a linear layer's packed weight takes the kernel's loops: MAX_ROWS_AVX512 where the
    AVX-512 loop multiplies, else MAX_ROWS."""
    return MAX_ROWS_AVX512 if avx512() else MAX_ROWS


def max_block_rows() -> int:
    """Rows up to which GGUF block rows (not AMX-tiled) take the kernel: the larger of MAX_ROWS_BLOCKS and
    ``max_rows()``."""
    return max(max_rows(), MAX_ROWS_BLOCKS)


def max_fused() -> int:
    """Rows a fused decoder-layer pass may take: MAX_FUSED_AMX where AMX multiplies, else MAX_FUSED."""
    return MAX_FUSED_AMX if amx() else MAX_FUSED


def amx_int8() -> bool:
    """Whether int8 (draft) weights are multiplied with AMX-INT8 tiles: ``amx()``, the CPU has AMX-INT8
    and its self-check passed."""
    return amx() and "amx_int8" in _cpu_flags() and "amx-int8" not in _failed


def amx_blocks() -> bool:
    """Whether GGUF blocks (Q4_1, Q8_0) are tiled for AMX (``_amx_blocks``): ``amx()``, the CPU has
    AVX512-BF16 (the Q8_0 unpacking converts with it; every AMX CPU so far has it) and VERISPEC_AMX_BLOCKS
    is not 0. Read when weights are packed. Each format's own self-check may still turn it off
    (``_failed``)."""
    return amx() and "avx512_bf16" in _cpu_flags() and os.environ.get("VERISPEC_AMX_BLOCKS", "1") != "0"


def amx() -> bool:
    """Whether bf16 weights are multiplied with AMX tiles (``library()`` loaded, the CPU has AMX-BF16, the
    OS granted it, the self-check passed and VERISPEC_AMX is not 0). Read when weights are packed."""
    return library() is not None and not _amx_reason


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., K) fp32 @ weight (N, K)^T (+ bias) with the kernel; weight packed in one of FORMATS (fp32
    or bf16 with K % 8 == 0, AMX tiles from ``_pack_weight``, int8 from ``quantize_int8``, GGUF blocks
    from ``_pack_weight``). Checks what the kernel would otherwise read or write out of bounds (the
    input's width, dtype and device, the bias's size) and raises ValueError, as F.linear raises on a
    width that does not match. Call only when ``library()`` is not None."""
    features = packed_inputs(weight)
    if x.shape[-1] != features:
        raise ValueError(f"the input has {x.shape[-1]} features but the weight ({weight.shape[0]} outputs) "
                         f"takes {features}")
    if x.dtype != torch.float32 or x.is_cuda or not weight.is_contiguous():
        layout = "contiguous" if weight.is_contiguous() else "strided"
        raise ValueError(f"the kernel takes fp32 CPU inputs and a contiguous weight, not {x.dtype} inputs on "
                         f"{x.device} and a {layout} weight")
    if bias is not None and (bias.shape != (weight.shape[0],) or bias.dtype != torch.float32
                             or not bias.is_contiguous()):
        raise ValueError(f"the bias must be {weight.shape[0]} contiguous fp32 values, not {tuple(bias.shape)} "
                         f"{bias.dtype}")
    return _product(library(), x.contiguous(), weight, bias, features)


def _product(lib: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
             features: int) -> torch.Tensor:
    """``linear`` without its checks: x contiguous fp32 (..., features)."""
    out_features = weight.shape[0]
    out = torch.empty(*x.shape[:-1], out_features, dtype=torch.float32)
    failed = lib.small_m_linear(x.data_ptr(), weight.data_ptr(), WEIGHT_TYPES[weight.dtype], out.data_ptr(),
                                _pointer(bias), x.numel() // features, features, out_features, torch.get_num_threads())
    if failed:
        raise MemoryError(f"the AMX kernel could not allocate scratch memory for {x.numel() // features} rows")
    return out


def rows_for(packed: torch.Tensor) -> int:
    """Rows up to which a linear layer with this packed weight takes the kernel: MAX_FUSED_AMX on AMX
    tiles (int16-held bf16, uint8-held int8, AMX_BLOCKS' GGUF blocks), INT8_ROWS for the AVX2 loop's int8
    rows, ``max_block_rows()`` for GGUF blocks, ``max_rows()`` for the other formats."""
    if packed.dtype == torch.int8:
        return INT8_ROWS
    if packed.dtype in (torch.int16, torch.uint8, *AMX_BLOCKS.values()):
        return MAX_FUSED_AMX
    return max_block_rows() if packed.dtype in GGUF_DTYPES else max_rows()


def weight_for_rows(packed: torch.Tensor, quantized: torch.Tensor | None, rows: int) -> torch.Tensor:
    """The weight a pass of ``rows`` rows multiplies with: the int8 one (``quantize``) when there is one
    and its format takes that many rows (``rows_for``), else the packed one."""
    return quantized if quantized is not None and rows <= rows_for(quantized) else packed


def _few_rows(x: torch.Tensor, width: int, *parameters: torch.Tensor, limit: int | None = None) -> bool:
    """The kernel's domain: at most ``max_rows()`` (or ``limit``) rows of ``width`` fp32 values on the CPU,
    no autograd."""
    return (x.dtype == torch.float32 and not x.is_cuda and x.numel() <= (limit or max_rows()) * width
            and not (torch.is_grad_enabled() and any(t.requires_grad for t in (x, *parameters))))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """``F.rms_norm(x, weight.shape, weight, eps)`` in one native call for few fp32 CPU rows without
    autograd; None when that does not apply (the caller uses torch's)."""
    size = weight.shape[-1]
    if weight.dtype != torch.float32 or size % 8 or not _few_rows(x, size, weight) or library() is None:
        return None
    x = x.contiguous()
    out = torch.empty_like(x)
    library().rms_norm(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // size, size, eps)
    return out


def _pointer(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


def status(model: nn.Module | None = None) -> str:
    """One line: whether the kernel is in use (for ``model``: how many layers on which weights, and
    how many rows take it) and its paths on this CPU (``paths``)."""
    if library() is None:
        return f"off ({_reason})"
    if model is None:
        return f"available ({paths()})"
    layers = [m for m in model.modules() if isinstance(m, SmallRowsLinear)]
    if not layers:
        return f"available, not applied to this model ({paths()})"
    bf16 = sum(m.packed.dtype in (torch.bfloat16, torch.int16) for m in layers)
    tiled = sum(m.packed.dtype == torch.int16 for m in layers)
    tiled_blocks = sum(m.packed.dtype in AMX_BLOCKS.values() for m in layers)
    fused = f"whole decoder layers <= {max_fused()} rows" if FUSED_LAYERS else "per-op layers: VERISPEC_FUSED_LAYERS=0"
    tiles = f"{tiled} on AMX tiles" if tiled else "none on AMX tiles"  # why not: in paths()
    quantized = [m.quantized for m in layers if m.quantized is not None]
    int8 = ""
    if quantized:
        on_tiles = sum(q.dtype == torch.uint8 for q in quantized)
        where = f"{on_tiles} on AMX-INT8 tiles" if on_tiles else f"int8 rows for <= {INT8_ROWS} rows"
        int8 = f", {len(quantized)} with int8 weights ({where})"
    blocks = ""
    k_quants = sum(m.packed.dtype == PAIRS and getattr(m, "gguf_blocks", ("",))[0] == "Q4_K" for m in layers)
    pairs = sum(m.packed.dtype == PAIRS for m in layers) - k_quants
    for kind, dtype in BLOCK_FORMATS.items():
        on_tiles = sum(m.packed.dtype == AMX_BLOCKS[kind] for m in layers)
        count = sum(m.packed.dtype == dtype for m in layers) + on_tiles + (pairs if kind == "Q4_1" else 0)
        blocks += f", {count} on {kind} blocks" if count else ""
        detail = ([f"{pairs} repacked in pairs"] if pairs and kind == "Q4_1" else []) + \
            ([f"{on_tiles} on AMX tiles"] if on_tiles else [])
        blocks += f" ({', '.join(detail)})" if count and detail else ""
    blocks += f", {k_quants} on Q4_K blocks (as Q4_1 pairs)" if k_quants else ""
    q6_k = sum(m.packed.dtype == Q6_K_ROWS for m in layers)
    blocks += f", {q6_k} on Q6_K blocks" if q6_k else ""
    unused = sum(getattr(m, "gguf_blocks", None) is not None and m.packed.dtype not in GGUF_DTYPES for m in layers)
    if unused:
        blocks += f", {unused} with GGUF blocks not used (another format, K % 32, or not the weight's values)"
    limits = [f"<= {MAX_FUSED_AMX} rows on tiles"] if tiled or tiled_blocks else []
    on_blocks = sum(m.packed.dtype in GGUF_DTYPES and m.packed.dtype not in AMX_BLOCKS.values() for m in layers)
    if on_blocks and max_block_rows() > max_rows():
        limits.append(f"<= {max_block_rows()} rows on GGUF blocks")
    rows = ", ".join(limits + [f"else <= {max_rows()}" if limits else f"<= {max_rows()} rows"])
    weights = f"{bf16} with bf16 weights ({tiles}){int8}{blocks}"
    return f"on ({len(layers)} linear layers, {weights}, {rows}; {fused}; {paths()})"


def paths() -> str:
    """The instruction-set paths the kernel multiplies with on this CPU and the weight formats each
    takes, e.g. "avx2: fp32, bf16, int8, Q4_1, Q8_0, Q4_1 pairs; AVX-512 off: no AVX-512 F/BW/VL/DQ on this CPU; AMX
    off: no AMX-BF16 on this CPU", and any path
    the load-time self-check turned off, with why. Call when ``library()`` is not None."""
    loop = [form.name for form in FORMATS.values() if form.rows_multiple == 1 and form.name not in _failed]
    if library().avx512_on():
        text = f"avx512: {', '.join(loop)} (K % 16 == 0, else avx2)"
    else:
        text = f"avx2: {', '.join(loop)}" + (f"; AVX-512 off: {_avx512_reason}" if _avx512_reason else
                                             "; AVX-512 off: switched off (set_avx512)")
    tiled_blocks = [FORMATS[dtype].name for dtype in AMX_BLOCKS.values() if FORMATS[dtype].name not in _failed]
    extra = (["amx-int8"] if amx_int8() else []) + (tiled_blocks if amx_blocks() else [])
    text += f"; {', '.join(['amx-bf16', *extra])}" if amx() else f"; AMX off: {_amx_reason}"
    if _failed:
        text += "; self-check turned off " + ", ".join(f"{name} ({why})" for name, why in _failed.items())
    return text


from verispec.kernels.build import (  # noqa: E402, F401  (re-exported; reads and sets the state above)
    _check_weights, _compiler_identity, _cpu_flags, _self_check, cache_dir, library, library_path)
from verispec.kernels.packing import (  # noqa: E402, F401  (re-exported)
    Arena, _int8_tiles, _pack_blocks, _pack_weight, _tiles, advise_huge_pages, quantize_int8)
from verispec.kernels.layers import (  # noqa: E402, F401  (re-exported)
    GROUPS, Group, SmallRowsLinear, accelerate, first_rows, gather, joined_projection, projections, quantize)
from verispec.kernels.fused import (  # noqa: E402, F401  (re-exported; the fused passes use the definitions above)
    LayerPlan, LayerWeights, PassArgs, decoder_layer, decoder_layers, fused_applies, head_weight, model_pass,
    pass_fits)
