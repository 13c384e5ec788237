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
    # (accelerate, quantize, projections, SmallRowsLinear: layers.py; fused passes: fused.py; weight
    # formats: formats.py; all re-exported here)
    status(model)          # "on (57 linear layers, 57 with bf16 weights (...), <= 16 rows; whole decoder
                           #  layers <= 64 rows; avx512: fp32, bf16, int8, Q4_1, Q8_0 (K % 16 == 0, else
                           #  avx2); AMX off: ...)" or why not

The kernel sums every output in the same order whatever the number of rows, so a row's projection is
bit-identical whether it is decoded alone or verified with others. It is compiled with the system C
compiler into ``$VERISPEC_CACHE_DIR`` (default ``~/.cache/verispec``) keyed by the source, the
compiler's path and version and the flags (``library_path``); where that fails (no compiler, no
AVX2/FMA/F16C, not x86-64) or ``VERISPEC_KERNELS=0`` is set, every layer keeps torch's own path and
``status()`` says why. Training never uses it (it has no backward).

Weight formats (``FORMATS`` in ``formats.py``, re-exported here, told by the packed tensor's dtype):
fp32, bf16 (exact for a bf16 checkpoint), AMX tiles, int8 for drafts (``quantize``), and GGUF block rows,
Q4_1 and Q8_0: a loader that sets ``module.gguf_blocks = (format name, uint8 (N, row bytes))`` on an
nn.Linear whose fp32 weight holds those rows' dequantized values, before ``accelerate``, gets the file's
rows multiplied directly (``_pack_blocks``): exactly the dequantized values, at 4.5 or 8.5 bits a weight
read. Self-check: loading runs one small product per weight path against float64 (``_self_check``); a
path that disagrees is not packed for (fp32: the library stays off), and ``status()`` says so.

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

Fused decoder layers (``fused.py``, re-exported here): ``decoder_layer`` runs a whole Llama decoder layer
of a pass of up to ``max_fused()`` rows in one call (the native model's ``run_layers`` uses it where
``fused_applies`` and ``LayerWeights.for_layer`` allow), since at these sizes torch's per-op dispatch
costs more than the arithmetic. Row results are again independent of the other rows in the pass. """

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

import torch
from torch import nn

from verispec.kernels.formats import (  # noqa: F401  (re-exported)
    BLOCK_FORMATS, FORMATS, WEIGHT_TYPES, Format, _int8_rows, _int8_values, _random_blocks, block_bytes,
    dequantize_blocks, packed_inputs)

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


def _int8_tiles(lib: ctypes.CDLL, values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    tiled = torch.empty(values.shape[0], values.shape[1] + 4, dtype=torch.uint8)
    scales = scale.reshape(-1).contiguous()
    lib.pack_amx_i8(values.data_ptr(), scales.data_ptr(), tiled.data_ptr(), *values.shape)
    return tiled


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


from verispec.kernels.layers import (  # noqa: E402, F401  (re-exported)
    GROUPS, Group, SmallRowsLinear, accelerate, joined_projection, projections, quantize)
from verispec.kernels.fused import (  # noqa: E402, F401  (re-exported; the fused passes use the definitions above)
    LayerPlan, LayerWeights, PassArgs, decoder_layer, decoder_layers, fused_applies, head_weight, model_pass,
    pass_fits)
