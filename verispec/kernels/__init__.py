"""Native few-row linear kernel for CPU inference (AVX2 + FMA; AVX-512 where the CPU has F/BW/VL/DQ;
AMX tiles where it has AMX-BF16), built on first use.

Decoding multiplies 1 row by every weight matrix and verification K + 1 rows. On AVX2 machines torch's
GEMM costs about twice as much for 8 rows as for 1 although the weights, the dominant memory traffic,
are the same; ``small_m_linear.c`` reads each weight once per call for all rows, and reads bf16
weights directly when a checkpoint's values are bf16 (the fp32 copy is then an exact upcast, so the
products are the same numbers at half the traffic).

    accelerate(model)      # every eligible nn.Linear of model uses the kernel for <= MAX_ROWS rows
    gate, up = projections(x, mlp.gate_proj, mlp.up_proj)   # one call for both
    qkv = joined_projection(x, attn.q_proj, attn.k_proj, attn.v_proj)   # (..., q | k | v)
    status(model)          # "on (57 linear layers, 57 with bf16 weights (...), <= 16 rows; whole decoder
                           #  layers <= 64 rows; avx512: fp32, bf16, int8, Q4_1, Q8_0 (K % 16 == 0, else
                           #  avx2); AMX off: ...)" or why not

The kernel sums every output in the same order whatever the number of rows, so a row's projection is
bit-identical whether it is decoded alone or verified with others. It is compiled with the system C
compiler into ``$VERISPEC_CACHE_DIR`` (default ``~/.cache/verispec``) keyed by the source, the
compiler's path and version and the flags (``library_path``); where that fails (no compiler, no
AVX2/FMA/F16C, not x86-64) or ``VERISPEC_KERNELS=0`` is set, every layer keeps torch's own path and
``status()`` says why. Training never uses it (it has no backward).

Weight formats (``FORMATS``, told by the packed tensor's dtype): fp32, bf16 (exact for a bf16
checkpoint), AMX tiles, int8 for drafts (``quantize``), and GGUF block rows, Q4_1 and Q8_0: a loader
that sets ``module.gguf_blocks = (format name, uint8 (N, row bytes))`` on an nn.Linear whose fp32
weight holds those rows' dequantized values, before ``accelerate``, gets the file's rows multiplied
directly (``_pack_blocks``): exactly the dequantized values, at 4.5 or 8.5 bits a weight read.
Self-check: loading runs one small product per weight path against float64 (``_self_check``); a path
that disagrees is not packed for (fp32: the library stays off), and ``status()`` says so.

AVX-512: on CPUs with AVX-512 F/BW/VL/DQ the same formats go through a 16-lane loop (``avx512()``;
products of K % 16 == 0, other widths the AVX2 loop), checked at load like the others: a failing
self-check turns it off (the AVX2 loop is then checked alone), as does VERISPEC_AVX512=0; ``status()``
names the loop in use. Each loop keeps rows independent; the two sum in different orders, so their
bits differ by rounding (one process uses one loop for every pass unless ``set_avx512`` switches it).

AMX: on CPUs with AMX-BF16 (Intel Sapphire Rapids and later; Linux grants the tile state per process)
bf16 weights whose shape is whole 16 x 32 tiles are stored tiled (int16 bit patterns, see
``_pack_weight``) and multiplied with tile instructions, x split exactly into three bf16 parts so the
products are exact and only fp32 accumulation rounds. A pass of 1..16 rows then costs about the same
as one row (``verispec profile`` measures verify(n) / decode(1); docs/results.md). Row results stay
independent of the other rows. VERISPEC_AMX=0
keeps the AVX2 loop; ``status()`` says which path the weights took.

Fused decoder layers: ``decoder_layer`` runs a whole Llama decoder layer of a pass of up to ``max_fused()``
rows in one call (the native model's ``run_layers`` uses it where ``fused_applies`` and
``LayerWeights.for_layer`` allow), since at these sizes torch's per-op dispatch costs more than the
arithmetic. Row results are again independent of the other rows in the pass.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

SOURCE = Path(__file__).with_name("small_m_linear.c")
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC", "-lm"]
MAX_ROWS = 16  # beyond this torch's GEMM is as good (measured: experiments/small_m_kernel.py)
# On AMX tiles the kernel beats torch's fp32 GEMM far beyond 16 rows: the embedded target's LM head
# (8192 x 384) costs 0.48 vs 1.55 ms at 32 rows and 1.49 vs 4.47 ms at 128 (experiments/amx_linear.py).
# Whole decoder layers in one native call (``decoder_layer``) where the kernel applies; VERISPEC_FUSED_LAYERS=0
# keeps the per-op torch path (layers still use the linear kernel). Read at each pass, so tests and
# experiments may flip it.
FUSED_LAYERS = os.environ.get("VERISPEC_FUSED_LAYERS", "1") != "0"
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


class Format(NamedTuple):
    """A packed weight's layout, told by its torch dtype: ``wtype`` is the C source's weight type,
    ``name`` the weight path (as ``status`` and the self-check name it). A row of K inputs is stored as
    ``extra`` columns then ``columns`` columns per ``inputs`` inputs; N % rows_multiple == 0 and
    K % inputs_multiple == 0."""

    wtype: int
    name: str
    columns: int
    inputs: int
    extra: int
    rows_multiple: int
    inputs_multiple: int


FORMATS = {
    torch.float32: Format(0, "fp32", 1, 1, 0, 1, 8),
    torch.bfloat16: Format(1, "bf16", 1, 1, 0, 1, 8),
    torch.int16: Format(2, "amx-bf16", 1, 1, 0, 16, 32),  # bf16 bit patterns, tiled
    torch.int8: Format(3, "int8", 1, 1, 4, 1, 8),  # a row: its fp32 scale, then K values
    torch.uint8: Format(4, "amx-int8", 1, 1, 4, 16, 64),  # tiled, see quantize_int8
    torch.int32: Format(5, "Q4_1", 5, 32, 0, 1, 32),  # a GGUF row's bytes, 20 a block of 32 weights
    torch.uint16: Format(6, "Q8_0", 17, 32, 0, 1, 32),  # a GGUF row's bytes, 34 a block of 32 weights
}
WEIGHT_TYPES = {dtype: form.wtype for dtype, form in FORMATS.items()}  # C's wtype
BLOCK_FORMATS = {form.name: dtype for dtype, form in FORMATS.items() if form.inputs == 32}  # "Q4_1" -> int32


def cache_dir() -> Path:
    return Path(os.environ.get("VERISPEC_CACHE_DIR") or Path.home() / ".cache" / "verispec")


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _compiler_identity(compiler: str) -> str:
    """The compiler's resolved path and the first line of its ``--version``."""
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        version = ""
    return f"{os.path.realpath(shutil.which(compiler) or compiler)}\n{(version.splitlines() or ['?'])[0]}"


def library_path(compiler: str) -> Path:
    """Where ``library()`` keeps the build by ``compiler``: keyed by the source, the compiler's identity
    (``_compiler_identity``) and FLAGS, so a changed compiler, CC or flag builds afresh instead of
    loading another build."""
    identity = "\n".join([_compiler_identity(compiler), *FLAGS]).encode()
    key = hashlib.sha256(SOURCE.read_bytes() + b"\n" + identity).hexdigest()[:16]
    return cache_dir() / f"small_m_linear-{key}.so"


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded kernel library, or None (``status()`` says why). Loading runs ``_self_check``."""
    global _reason
    if os.environ.get("VERISPEC_KERNELS", "1") == "0":
        _reason = "disabled by VERISPEC_KERNELS=0"
        return None
    if platform.machine().lower() not in ("x86_64", "amd64") or not {"avx2", "fma", "f16c"} <= _cpu_flags():
        _reason = "needs an x86-64 CPU with AVX2, FMA and F16C"
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        _reason = "no C compiler (set CC or install gcc)"
        return None
    target = library_path(compiler)
    if not target.exists():
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
                built = Path(scratch) / target.name
                # A compiler without AMX (then also AVX-512) intrinsics builds without those paths.
                for fewer in ([], ["-DVERISPEC_NO_AMX"], ["-DVERISPEC_NO_AMX", "-DVERISPEC_NO_AVX512"]):
                    try:
                        subprocess.run([compiler, *FLAGS, *fewer, "-o", str(built), str(SOURCE)], check=True,
                                       capture_output=True, timeout=120)
                        break
                    except subprocess.CalledProcessError:
                        if "-DVERISPEC_NO_AVX512" in fewer:
                            raise
                os.replace(built, target)  # atomic: concurrent builders each install a whole file
        except (OSError, subprocess.SubprocessError) as error:
            detail = getattr(error, "stderr", b"") or b""
            _reason = f"build failed ({error.__class__.__name__}: {detail.decode(errors='replace')[:200]})"
            return None
    try:
        lib = ctypes.CDLL(str(target))
    except OSError as error:
        _reason = f"load failed ({error})"
        return None
    lib.small_m_linear.restype = ctypes.c_int
    lib.small_m_linear.argtypes = ([ctypes.c_void_p] * 2 + [ctypes.c_int] + [ctypes.c_void_p] * 2
                                   + [ctypes.c_long] * 3 + [ctypes.c_int])
    lib.pack_amx_i8.restype = None
    lib.pack_amx_i8.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 2
    lib.pack_amx.restype = None
    lib.pack_amx.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_long] * 2
    lib.amx_init.restype = ctypes.c_int
    lib.amx_init.argtypes = []
    lib.set_avx512.restype = ctypes.c_int
    lib.set_avx512.argtypes = [ctypes.c_int]
    lib.avx512_on.restype = ctypes.c_int
    lib.avx512_on.argtypes = []
    lib.rms_norm.restype = None
    lib.rms_norm.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 2 + [ctypes.c_float]
    lib.decoder_layer.restype = ctypes.c_int
    lib.decoder_layer.argtypes = ([ctypes.c_void_p] + [ctypes.c_long] * 7 + [ctypes.c_float]
                                  + [ctypes.c_void_p] * 10 + [ctypes.c_int] + [ctypes.c_void_p] * 4
                                  + [ctypes.c_long, ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p, ctypes.c_int])
    lib.model_pass.restype = ctypes.c_int
    lib.model_pass.argtypes = ([ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p] + [ctypes.c_long] * 6
                               + [ctypes.c_float, ctypes.c_void_p, ctypes.c_long] + [ctypes.c_void_p] * 4
                               + [ctypes.c_long] * 2 + [ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p, ctypes.c_float,
                                                        ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_long,
                                                        ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                                        ctypes.c_int])
    lib.decoder_layers.restype = ctypes.c_int
    lib.decoder_layers.argtypes = ([ctypes.c_void_p] + [ctypes.c_long] * 7 + [ctypes.c_float]
                                   + [ctypes.c_void_p, ctypes.c_long] + [ctypes.c_void_p] * 4
                                   + [ctypes.c_long] * 2 + [ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p, ctypes.c_int])
    global _amx_reason
    if os.environ.get("VERISPEC_AMX", "1") == "0":
        _amx_reason = "disabled by VERISPEC_AMX=0"
    elif not {"amx_bf16", "amx_tile"} <= _cpu_flags():
        _amx_reason = "no AMX-BF16 on this CPU"
    elif not lib.amx_init():
        _amx_reason = "AMX not built (compiler) or not granted by the OS"
    else:
        _amx_reason = ""
    global _avx512_reason
    lib.set_avx512(0)  # a library loaded before keeps its switch across library.cache_clear()
    if os.environ.get("VERISPEC_AVX512", "1") == "0":
        _avx512_reason = "disabled by VERISPEC_AVX512=0"
    elif not AVX512_FLAGS <= _cpu_flags():
        _avx512_reason = "no AVX-512 F/BW/VL/DQ on this CPU"
    elif not lib.set_avx512(1):
        _avx512_reason = "not built (compiler without AVX-512 intrinsics)"
    else:
        _avx512_reason = ""
    _self_check(lib)
    if not _avx512_reason and _failed:  # the AVX-512 loop off, then the AVX2 loop checked on its own
        _avx512_reason = "self-check failed: " + ", ".join(f"{name} ({why})" for name, why in _failed.items())
        lib.set_avx512(0)
        _self_check(lib)
    if "fp32" in _failed:  # every other path falls back to fp32 weights: nothing left to run
        _reason = f"self-check failed for fp32 weights ({_failed['fp32']})"
        return None
    if "amx-bf16" in _failed:
        _amx_reason = f"self-check failed ({_failed['amx-bf16']})"
    _reason = ""
    return lib


def _self_check(lib: ctypes.CDLL) -> None:
    """One small product (7 rows, 64 inputs, with a bias) per weight path this CPU runs, against
    float64: a path that disagrees (a miscompiled or mis-executed build) is recorded in ``_failed`` and
    its weights are then packed for another path (``_pack_weight``, ``quantize_int8``; fp32 failing
    turns the library off). The inputs are integers with a maximum of 127 per row, which AMX-INT8
    quantizes exactly, so every path's product is fp32-accurate."""
    _failed.clear()
    generator = torch.Generator().manual_seed(0)
    x = torch.randint(-127, 128, (7, 64), generator=generator).float()
    x[:, 0] = 127.0
    bias = torch.randn(18, generator=generator)
    for name, (packed, values) in _check_weights(lib, generator).items():
        values, rows_bias = values.double(), bias[:packed.shape[0]]
        try:
            got = _product(lib, x, packed, rows_bias, 64).double()
        except MemoryError as error:
            _failed[name] = str(error)
            continue
        want = x.double() @ values.T + rows_bias.double()
        error = (got - want).abs()
        if not bool((error <= 1e-5 * (x.double().abs() @ values.abs().T + rows_bias.double().abs())).all()):
            _failed[name] = f"off by up to {float(error.max()):.3g} against float64"


def _check_weights(lib: ctypes.CDLL, generator: torch.Generator) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Weight path -> (packed 18 x 64 weight, or 16 x 64 for AMX tiles; its values) for ``_self_check``."""
    exact = torch.randn(18, 64, generator=generator).to(torch.bfloat16)
    values, scale = _int8_values(torch.randn(18, 64, generator=generator))
    fp32 = torch.randn(18, 64, generator=generator)
    weights = {"fp32": (fp32, fp32), "bf16": (exact, exact.float()),
               "int8": (_int8_rows(values, scale), values.double() * scale.double())}
    for kind, dtype in BLOCK_FORMATS.items():
        raw = _random_blocks(kind, 18, 64, generator)
        weights[kind] = (raw.view(dtype), dequantize_blocks(kind, raw))
    if not _amx_reason:
        weights["amx-bf16"] = (_tiles(lib, exact[:16]), exact[:16].float())
        if "amx_int8" in _cpu_flags():
            weights["amx-int8"] = (_int8_tiles(lib, values[:16], scale[:16]), weights["int8"][1][:16])
    return weights


def avx512() -> bool:
    """Whether the AVX-512 loop multiplies (``library()`` loaded, the CPU has AVX-512 F/BW/VL/DQ, the
    self-check passed and VERISPEC_AVX512 is not 0) for calls whose K is a multiple of 16; other calls,
    and every call elsewhere, take the AVX2 loop. AMX tiles, where packed, take precedence."""
    return library() is not None and not _avx512_reason


def set_avx512(on: bool) -> bool:
    """Switch the AVX-512 loop on or off for later products (tests and A/B experiments: the packed
    weights are the same for both loops); returns whether it is on. On only where ``avx512()`` allows."""
    lib = library()
    return bool(lib is not None and lib.set_avx512(int(on and not _avx512_reason)))


def max_fused() -> int:
    """Rows a fused decoder-layer pass may take: MAX_FUSED_AMX where AMX multiplies, else MAX_FUSED."""
    return MAX_FUSED_AMX if amx() else MAX_FUSED


def amx_int8() -> bool:
    """Whether int8 (draft) weights are multiplied with AMX-INT8 tiles: ``amx()``, the CPU has AMX-INT8
    and its self-check passed."""
    return amx() and "amx_int8" in _cpu_flags() and "amx-int8" not in _failed


def amx() -> bool:
    """Whether bf16 weights are multiplied with AMX tiles (``library()`` loaded, the CPU has AMX-BF16, the
    OS granted it, the self-check passed and VERISPEC_AMX is not 0). Read when weights are packed."""
    return library() is not None and not _amx_reason


def packed_inputs(weight: torch.Tensor) -> int:
    """K of a packed weight (N, ...) of a FORMATS dtype; ValueError where its shape is not one the
    format can have."""
    form = FORMATS.get(weight.dtype)
    if form is None or weight.dim() != 2:
        raise ValueError(f"not a packed weight for the kernel: {weight.dtype} of shape {tuple(weight.shape)}")
    body = weight.shape[1] - form.extra
    size = body // form.columns * form.inputs
    if body % form.columns or size % form.inputs_multiple or weight.shape[0] % form.rows_multiple or size <= 0:
        raise ValueError(f"a {form.name} weight of {tuple(weight.shape)} {weight.dtype} values does not hold whole "
                         f"rows of a multiple of {form.inputs_multiple} inputs")
    return size


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
    tiles (int16-held bf16, uint8-held int8), INT8_ROWS for the AVX2 loop's int8 rows, MAX_ROWS for its
    other formats. GGUF blocks too: their dequantization is redone per chunk of 6 rows, and on the
    Zen 3 torch's GEMM of the fp32 weight took 0.7x the kernel's time at 32 and 64 rows for 576 x 1536
    and 1536 x 576 layers in cache (only a 49152 x 576 head still won at 32 rows)."""
    if packed.dtype == torch.int8:
        return INT8_ROWS
    return MAX_FUSED_AMX if packed.dtype in (torch.int16, torch.uint8) else MAX_ROWS


def weight_for_rows(packed: torch.Tensor, quantized: torch.Tensor | None, rows: int) -> torch.Tensor:
    """The weight a pass of ``rows`` rows multiplies with: the int8 one (``quantize``) when there is one
    and its format takes that many rows (``rows_for``), else the packed one."""
    return quantized if quantized is not None and rows <= rows_for(quantized) else packed


def _few_rows(x: torch.Tensor, width: int, *parameters: torch.Tensor, limit: int | None = None) -> bool:
    """The kernel's domain: at most MAX_ROWS (or ``limit``) rows of ``width`` fp32 values on the CPU,
    no autograd."""
    return (x.dtype == torch.float32 and not x.is_cuda and x.numel() <= (limit or MAX_ROWS) * width
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


def _pack_weight(weight: torch.Tensor, blocks: tuple[str, torch.Tensor] | None = None) -> torch.Tensor:
    """The weight as the kernel reads it. With ``blocks`` (a layer's ``gguf_blocks``, see
    ``_pack_blocks``) that hold exactly ``weight``: those GGUF rows. Else bf16 when that loses nothing (a
    bf16 checkpoint upcast to fp32), else the fp32 weight. With AMX (``amx()``) and N % 16 == 0, K % 32
    == 0, such bf16 weights are stored tiled for the tile multiply (``pack_amx`` in the C source), as
    int16 bit patterns of the same (N, K) shape: no torch op reads them as a matrix by mistake, and row
    blocks of 16 still cut and join like rows. A path the self-check turned off is not packed for."""
    weight = weight.detach()
    packed = None if blocks is None else _pack_blocks(weight, *blocks)
    if packed is not None:
        return packed
    as_bf16 = weight.to(torch.bfloat16)
    if not torch.equal(as_bf16.to(torch.float32), weight):
        return weight.contiguous()
    as_bf16 = as_bf16.contiguous()
    out_features, in_features = weight.shape
    if amx() and out_features % 16 == 0 and in_features % 32 == 0:
        return _tiles(library(), as_bf16)
    return weight.contiguous() if "bf16" in _failed else as_bf16


def _tiles(lib: ctypes.CDLL, weight: torch.Tensor) -> torch.Tensor:
    """bf16 (N, K) contiguous -> the AMX tile order (``pack_amx``), as int16 (N, K)."""
    tiled = torch.empty(weight.shape, dtype=torch.int16)
    lib.pack_amx(weight.data_ptr(), tiled.data_ptr(), *weight.shape)
    return tiled


def _pack_blocks(weight: torch.Tensor, kind: str, raw: torch.Tensor) -> torch.Tensor | None:
    """GGUF rows for the kernel: ``raw`` uint8 (N, row bytes), row n the file's row for output n in one
    of BLOCK_FORMATS (``kind``: "Q4_1" or "Q8_0"; layouts in the C source at ``load_w_q4_1``), viewed as
    that format's dtype (Q4_1 int32 (N, K / 32 * 5), Q8_0 uint16 (N, K / 32 * 17)): no torch op reads
    them as numbers, and rows still cut and join like rows (q | k | v, gate | up). None, so the caller
    packs ``weight`` itself, unless K % 32 == 0, the format's self-check passed and the rows dequantize
    to exactly ``weight`` (a loader's row order mistake, or a weight edited in place, would otherwise
    make the kernel compute something else than torch's path)."""
    dtype = BLOCK_FORMATS.get(kind)
    out_features, in_features = weight.shape
    if dtype is None or kind in _failed or in_features % 32 or raw.dtype != torch.uint8 or raw.is_cuda \
            or weight.dtype != torch.float32 \
            or tuple(raw.shape) != (out_features, in_features // 32 * block_bytes(kind)):
        return None
    raw = raw.detach().contiguous()
    if raw.storage_offset() % dtype.itemsize:
        raw = raw.clone()
    for first in range(0, out_features, 4096):  # slices: the check's float copies stay small
        if not torch.equal(dequantize_blocks(kind, raw[first:first + 4096]), weight[first:first + 4096]):
            return None
    return raw.view(dtype)


def block_bytes(kind: str) -> int:
    """Bytes of one block of 32 weights in the GGUF format ``kind`` (one of BLOCK_FORMATS): 20 or 34."""
    dtype = BLOCK_FORMATS[kind]
    return FORMATS[dtype].columns * dtype.itemsize


def dequantize_blocks(kind: str, raw: torch.Tensor) -> torch.Tensor:
    """GGUF rows ``raw`` (uint8 (N, row bytes), ``kind`` "Q4_1" or "Q8_0") -> float32 (N, K), the values
    gguf-py's ``gguf.quants.dequantize`` gives (d * q + m, d * q in float32; d * q is exact)."""
    blocks = raw.reshape(raw.shape[0], -1, block_bytes(kind))
    d = blocks[..., 0:2].contiguous().view(torch.float16).float()
    if kind == "Q8_0":
        return (d * blocks[..., 2:].contiguous().view(torch.int8).float()).reshape(raw.shape[0], -1)
    m = blocks[..., 2:4].contiguous().view(torch.float16).float()
    qs = blocks[..., 4:]
    return (d * torch.cat([qs & 15, qs >> 4], dim=-1).float() + m).reshape(raw.shape[0], -1)


def _random_blocks(kind: str, out_features: int, in_features: int, generator: torch.Generator) -> torch.Tensor:
    """Random GGUF rows (uint8 (N, row bytes)) with finite scales, for the self-check."""
    raw = torch.randint(0, 256, (out_features, in_features // 32, block_bytes(kind)), dtype=torch.uint8,
                        generator=generator)
    headers = 1 if kind == "Q8_0" else 2  # d, or d and m
    scales = (torch.rand(out_features, in_features // 32, headers, generator=generator) - 0.25) * 0.1
    raw[..., :2 * headers] = scales.half().view(torch.uint8)
    return raw.reshape(out_features, -1)


def quantize_int8(weight: torch.Tensor) -> torch.Tensor | None:
    """(N, K) float -> (N, K + 4) bytes for ``linear``: per output row, an fp32 scale (max |w| / 127) and
    the K values rounded to multiples of it. With AMX-INT8 (``amx_int8()``) and N % 16 == 0, K % 64 == 0:
    uint8, tiled by ``pack_amx_i8`` (the C source; input rows are then quantised too, per row); else
    int8 rows, each its scale's 4 bytes then its values (the AVX2 loop, for up to INT8_ROWS rows), or
    None where the self-check turned int8 rows off. For draft models only: what a draft proposes
    decides acceptance, never the committed distribution."""
    values, scale = _int8_values(weight)
    out_features, in_features = weight.shape
    if amx_int8() and out_features % 16 == 0 and in_features % 64 == 0:
        return _int8_tiles(library(), values, scale)
    return None if "int8" in _failed else _int8_rows(values, scale)


def _int8_values(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_int8``'s values (int8 (N, K)) and scales (fp32 (N, 1))."""
    weight = weight.detach().float()
    scale = weight.abs().amax(dim=1, keepdim=True).clamp_min(1e-30) / 127.0
    return torch.round(weight / scale).clamp(-127, 127).to(torch.int8).contiguous(), scale


def _int8_rows(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    out = torch.empty(values.shape[0], values.shape[1] + 4, dtype=torch.int8)
    out[:, :4] = scale.view(torch.int8).reshape(-1, 4)
    out[:, 4:] = values
    return out


def _int8_tiles(lib: ctypes.CDLL, values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    tiled = torch.empty(values.shape[0], values.shape[1] + 4, dtype=torch.uint8)
    scales = scale.reshape(-1).contiguous()
    lib.pack_amx_i8(values.data_ptr(), scales.data_ptr(), tiled.data_ptr(), *values.shape)
    return tiled


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
        if _few_rows(x, self.in_features, self.weight, limit=rows_for(self.packed)):
            if self.weight._version != self.packed_version:  # weights edited in place since packing
                self._pack()
            return linear(x, weight_for_rows(self.packed, self.quantized, x.numel() // self.in_features), self.bias)
        return F.linear(x, self.weight, self.bias)

    def _pack(self) -> None:
        self.packed = _pack_weight(self.weight, getattr(self, "gguf_blocks", None))
        self.packed_version, self.group = self.weight._version, None
        if self.quantized is not None:
            self.quantized = quantize_int8(self.weight)


class Group:
    """Linear layers that read the same input (q/k/v, gate/up), packed as one matrix whose row blocks
    are the members' own packed weights (views, no extra memory): one kernel call computes them all."""

    def __init__(self, layers: tuple[SmallRowsLinear, ...]):
        self.layers = layers
        self.packed = torch.cat([layer.packed for layer in layers])
        self.quantized = None  # int8 rows of every member, when ``quantize`` gave each its own
        if all(layer.quantized is not None for layer in layers):
            self.quantized = torch.cat([layer.quantized for layer in layers])
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
            and _few_rows(x, layers[0].in_features, layers[0].weight, limit=rows_for(group.packed)):
        return group
    return None


def projections(x: torch.Tensor, *layers: nn.Module) -> tuple[torch.Tensor, ...]:
    """``tuple(layer(x) for layer in layers)``, in one kernel call when ``accelerate`` grouped them."""
    group = _ready_group(x, layers)
    if group is not None:
        return linear(x, weight_for_rows(group.packed, group.quantized, x.numel() // layers[0].in_features), group.bias).split(group.sizes, dim=-1)
    return tuple(layer(x) for layer in layers)


def joined_projection(x: torch.Tensor, *layers: nn.Module) -> torch.Tensor:
    """``torch.cat([layer(x) for layer in layers], -1)``, in one kernel call (no copy) when grouped."""
    group = _ready_group(x, layers)
    if group is not None:
        return linear(x, weight_for_rows(group.packed, group.quantized, x.numel() // layers[0].in_features), group.bias)
    return torch.cat([layer(x) for layer in layers], dim=-1)


GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # read through projections()


def accelerate(model: nn.Module) -> int:
    """Switch every eligible nn.Linear of ``model`` (fp32 on the CPU, in_features % 8 == 0) to the kernel
    for few-row calls and group the projections of GROUPS; returns how many layers were switched (0
    when the kernel is unavailable)."""
    if library() is None:
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
            on_blocks = layer.packed.dtype in BLOCK_FORMATS.values()
            layer.quantized = None if on_blocks else quantize_int8(layer.weight)
            layer.group = None
        for module in model.modules():
            module.__dict__.pop("_fused_weights", None)
            for names in GROUPS:
                members = tuple(getattr(module, name, None) for name in names)
                if Group.compatible(members):
                    Group(members)
    return sum(layer.quantized is not None for layer in layers)


def _pointer(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


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
            flags |= WEIGHT_TYPES[packed.dtype] << (4 * index)
        return (_pointer(norms[0].weight), qkv.data_ptr(), _pointer(self.qkv.bias), o.data_ptr(),
                _pointer(self.o.bias), _pointer(norms[1].weight), gate_up.data_ptr(), _pointer(self.gate_up.bias),
                down.data_ptr(), _pointer(self.down.bias), flags)

    @staticmethod
    def for_layer(layer: nn.Module) -> "LayerWeights | None":
        weights = getattr(layer, "_fused_weights", None)
        if weights is not None and weights.current():
            return weights
        attention, mlp = layer.self_attn, layer.mlp
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        linears = (attention.q_proj, attention.o_proj, mlp.gate_proj, mlp.down_proj)
        if not (all(isinstance(m, SmallRowsLinear) for m in linears)
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
                and all(type(m) is SmallRowsLinear for m in (*self.qkv.layers, *self.gate_up.layers, self.o, self.down))
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
            self.rows_int8 = rows_for(weights[0].qkv.quantized)

    def current(self) -> bool:
        """Every layer's weights as when planned: nothing edited in place, repacked or regrouped."""
        return ([t._version for t in self.watched] == self.versions
                and all(type(layer) is SmallRowsLinear and layer.group is group for layer, group in self.members)
                and all(type(layer) is SmallRowsLinear and layer.packed is packed and layer.quantized is quantized
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
    failed = library().decoder_layers(x.data_ptr(), batch, num_new, hidden, heads, kv_heads, head_dim, intermediate,
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
    return _few_rows(x, x.shape[-1], limit=max_fused()) and pass_fits(x.shape[-1], cache)


def pass_fits(width: int, cache) -> bool:
    """The pass-independent half of ``fused_applies``: the library, a width of whole 8-value lanes, and
    a cache the native layers can write (``_cache_fits``). The rows and their dtype are the caller's."""
    return width % 8 == 0 and library() is not None and getattr(cache, "keys", None) is not None and _cache_fits(cache)


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
    if type(head) is not SmallRowsLinear or head.bias is not None or head.weight._version != head.packed_version:
        return None
    if rows > max(rows_for(head.packed), rows_for(head.quantized) if head.quantized is not None else 0):
        return None
    return weight_for_rows(head.packed, head.quantized, rows)


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
            self.heads[rows] = None if weight is None else (weight.data_ptr(), WEIGHT_TYPES[weight.dtype], weight.shape[0])
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
    status = library().model_pass(
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
    if weights.pointers_int8 is not None and batch * num_new <= rows_for(weights.qkv.quantized):
        pointers = weights.pointers_int8
    failed = library().decoder_layer(x.data_ptr(), batch, num_new, hidden, heads, kv_heads, head_dim,
                                     intermediate, weights.eps, *pointers, cos.data_ptr(), sin.data_ptr(),
                                     keys.data_ptr(), values.data_ptr(), cache.max_len, lengths.data_ptr(),
                                     num_slots, None if mask is None else mask.data_ptr(), torch.get_num_threads())
    if failed:
        raise MemoryError(f"the fused decoder layer could not allocate scratch memory for {batch * num_new} rows "
                          f"and {num_slots} slots")


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
    fused = f"whole decoder layers <= {max_fused()} rows" if FUSED_LAYERS else "per-op layers: VERISPEC_FUSED_LAYERS=0"
    tiles = f"{tiled} on AMX tiles" if tiled else "none on AMX tiles"  # why not: in paths()
    quantized = [m.quantized for m in layers if m.quantized is not None]
    int8 = ""
    if quantized:
        on_tiles = sum(q.dtype == torch.uint8 for q in quantized)
        where = f"{on_tiles} on AMX-INT8 tiles" if on_tiles else f"int8 rows for <= {INT8_ROWS} rows"
        int8 = f", {len(quantized)} with int8 weights ({where})"
    blocks = ""
    for kind, dtype in BLOCK_FORMATS.items():
        count = sum(m.packed.dtype == dtype for m in layers)
        blocks += f", {count} on {kind} blocks" if count else ""
    unused = sum(getattr(m, "gguf_blocks", None) is not None and m.packed.dtype not in BLOCK_FORMATS.values()
                 for m in layers)
    if unused:
        blocks += f", {unused} with GGUF blocks not used (another format, K % 32, or not the weight's values)"
    rows = f"<= {MAX_FUSED_AMX} rows on tiles, else <= {MAX_ROWS}" if tiled else f"<= {MAX_ROWS} rows"
    return f"on ({len(layers)} linear layers, {bf16} with bf16 weights ({tiles}){int8}{blocks}, {rows}; {fused}; {paths()})"


def paths() -> str:
    """The instruction-set paths the kernel multiplies with on this CPU and the weight formats each
    takes, e.g. "avx2: fp32, bf16, int8, Q4_1, Q8_0; AVX-512 off: no AVX-512 F/BW/VL/DQ on this CPU; AMX
    off: no AMX-BF16 on this CPU", and any path
    the load-time self-check turned off, with why. Call when ``library()`` is not None."""
    loop = [form.name for form in FORMATS.values() if form.rows_multiple == 1 and form.name not in _failed]
    if library().avx512_on():
        text = f"avx512: {', '.join(loop)} (K % 16 == 0, else avx2)"
    else:
        text = f"avx2: {', '.join(loop)}" + (f"; AVX-512 off: {_avx512_reason}" if _avx512_reason else
                                             "; AVX-512 off: switched off (set_avx512)")
    text += f"; amx-bf16{', amx-int8' if amx_int8() else ''}" if amx() else f"; AMX off: {_amx_reason}"
    if _failed:
        text += "; self-check turned off " + ", ".join(f"{name} ({why})" for name, why in _failed.items())
    return text
