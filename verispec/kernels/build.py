"""Building and loading the kernel library: compile ``small_m_linear.c`` once per source, compiler and flags
(``library_path``), declare its C signatures, choose the AMX and AVX-512 paths this CPU may take and run the
load-time self-check (``_self_check``). Re-exported by ``verispec.kernels``; the package's state
(``_reason``, ``_amx_reason``, ``_avx512_reason``, ``_failed``) and names a test may patch (``FLAGS``,
``_product``) are read and written through the package (``_k``) at call time."""

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

from verispec import kernels as _k
from verispec.kernels.formats import (AMX_BLOCKS, BLOCK_FORMATS, FORMATS, _int8_rows, _int8_values, _random_blocks,
                                      _random_q6_k_rows, dequantize_blocks, dequantize_q6_k_rows, pair_blocks)


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
    identity = "\n".join([_compiler_identity(compiler), *_k.FLAGS]).encode()
    key = hashlib.sha256(_k.SOURCE.read_bytes() + b"\n" + identity).hexdigest()[:16]
    return cache_dir() / f"small_m_linear-{key}.so"


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded kernel library, or None (``status()`` says why). Loading runs ``_self_check``."""
    if os.environ.get("VERISPEC_KERNELS", "1") == "0":
        _k._reason = "disabled by VERISPEC_KERNELS=0"
        return None
    if platform.machine().lower() not in ("x86_64", "amd64") or not {"avx2", "fma", "f16c"} <= _cpu_flags():
        _k._reason = "needs an x86-64 CPU with AVX2, FMA and F16C"
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        _k._reason = "no C compiler (set CC or install gcc)"
        return None
    target = library_path(compiler)
    if not target.exists():
        failure = _build(compiler, target)
        if failure:
            _k._reason = failure
            return None
    try:
        lib = ctypes.CDLL(str(target))
    except OSError as error:
        _k._reason = f"load failed ({error})"
        return None
    _declare(lib)
    _choose_paths(lib)
    if "fp32" in _k._failed:  # every other path falls back to fp32 weights: nothing left to run
        _k._reason = f"self-check failed for fp32 weights ({_k._failed['fp32']})"
        return None
    if "amx-bf16" in _k._failed:
        _k._amx_reason = f"self-check failed ({_k._failed['amx-bf16']})"
    _k._reason = ""
    return lib


def _build(compiler: str, target: Path) -> str:
    """Compile the source into ``target``; "" when built, else why not."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
            built = Path(scratch) / target.name
            # A compiler without AMX (then also AVX-512) intrinsics builds without those paths.
            for fewer in ([], ["-DVERISPEC_NO_AMX"], ["-DVERISPEC_NO_AMX", "-DVERISPEC_NO_AVX512"]):
                try:
                    subprocess.run([compiler, *_k.FLAGS, *fewer, "-o", str(built), str(_k.SOURCE)], check=True,
                                   capture_output=True, timeout=120)
                    break
                except subprocess.CalledProcessError:
                    if "-DVERISPEC_NO_AVX512" in fewer:
                        raise
            os.replace(built, target)  # atomic: concurrent builders each install a whole file
    except (OSError, subprocess.SubprocessError) as error:
        detail = getattr(error, "stderr", b"") or b""
        return f"build failed ({error.__class__.__name__}: {detail.decode(errors='replace')[:200]})"
    return ""


def _declare(lib: ctypes.CDLL) -> None:
    """The C functions' result and argument types, as the source declares them."""
    lib.small_m_linear.restype = ctypes.c_int
    lib.small_m_linear.argtypes = ([ctypes.c_void_p] * 2 + [ctypes.c_int] + [ctypes.c_void_p] * 2
                                   + [ctypes.c_long] * 3 + [ctypes.c_int])
    lib.pack_amx_i8.restype = None
    lib.pack_amx_i8.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 2
    lib.pack_amx_blocks.restype = ctypes.c_long
    lib.pack_amx_blocks.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_long] * 2 + [ctypes.c_int]
    lib.pack_amx.restype = None
    lib.pack_amx.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_long] * 2
    lib.amx_init.restype = ctypes.c_int
    lib.amx_init.argtypes = []
    lib.set_avx512.restype = ctypes.c_int
    lib.set_avx512.argtypes = [ctypes.c_int]
    lib.avx512_on.restype = ctypes.c_int
    lib.avx512_on.argtypes = []
    lib.set_attention_pairs.restype = ctypes.c_int
    lib.set_attention_pairs.argtypes = [ctypes.c_int]
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
                                   + [ctypes.c_long] * 2
                                   + [ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p, ctypes.c_int])


def _choose_paths(lib: ctypes.CDLL) -> None:
    """Set ``_amx_reason`` and ``_avx512_reason`` ("" where that path multiplies) from the environment,
    the CPU and the build, then self-check every path; a failure with the AVX-512 loop on turns that
    loop off and checks the AVX2 loop on its own."""
    if os.environ.get("VERISPEC_AMX", "1") == "0":
        _k._amx_reason = "disabled by VERISPEC_AMX=0"
    elif not {"amx_bf16", "amx_tile"} <= _cpu_flags():
        _k._amx_reason = "no AMX-BF16 on this CPU"
    elif not lib.amx_init():
        _k._amx_reason = "AMX not built (compiler) or not granted by the OS"
    else:
        _k._amx_reason = ""
    lib.set_avx512(0)  # a library loaded before keeps its switch across library.cache_clear()
    if os.environ.get("VERISPEC_AVX512", "1") == "0":
        _k._avx512_reason = "disabled by VERISPEC_AVX512=0"
    elif not _k.AVX512_FLAGS <= _cpu_flags():
        _k._avx512_reason = "no AVX-512 F/BW/VL/DQ on this CPU"
    elif not lib.set_avx512(1):
        _k._avx512_reason = "not built (compiler without AVX-512 intrinsics)"
    else:
        _k._avx512_reason = ""
    _self_check(lib)
    # A loop format failing turns the AVX-512 loop off, then the AVX2 loop is checked on its own; AMX
    # paths failing are their own (tiles do not take the loops).
    failed = {name: why for name, why in _k._failed.items() if FORMATS[_dtype_of(name)].rows_multiple == 1}
    if not _k._avx512_reason and failed:
        _k._avx512_reason = "self-check failed: " + ", ".join(f"{name} ({why})" for name, why in failed.items())
        lib.set_avx512(0)
        _self_check(lib)


def _dtype_of(name: str) -> torch.dtype:
    """The packed dtype of the weight path ``name`` (a Format's name)."""
    return next(dtype for dtype, form in FORMATS.items() if form.name == name)


def _self_check(lib: ctypes.CDLL) -> None:
    """One small product (7 rows, 64 inputs, with a bias) per weight path this CPU runs, against
    float64: a path that disagrees (a miscompiled or mis-executed build) is recorded in ``_failed`` and
    its weights are then packed for another path (``_pack_weight``, ``quantize_int8``; fp32 failing
    turns the library off). The inputs are integers with a maximum of 127 per row, which AMX-INT8
    quantizes exactly, so every path's product is fp32-accurate."""
    failed = _k._failed
    failed.clear()
    generator = torch.Generator().manual_seed(0)
    x = torch.randint(-127, 128, (7, 64), generator=generator).float()
    x[:, 0] = 127.0
    bias = torch.randn(18, generator=generator)
    for name, (packed, values) in _check_weights(lib, generator).items():
        values, rows_bias = values.double(), bias[:packed.shape[0]]
        try:
            got = _k._product(lib, x, packed, rows_bias, 64).double()
        except MemoryError as error:
            failed[name] = str(error)
            continue
        want = x.double() @ values.T + rows_bias.double()
        error = (got - want).abs()
        if not bool((error <= 1e-5 * (x.double().abs() @ values.abs().T + rows_bias.double().abs())).all()):
            failed[name] = f"off by up to {float(error.max()):.3g} against float64"


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
    weights["Q4_1 pairs"] = (pair_blocks(raw := _random_blocks("Q4_1", 18, 64, generator)),
                             dequantize_blocks("Q4_1", raw))
    weights["Q6_K rows"] = (rows := _random_q6_k_rows(18, 64, generator), dequantize_q6_k_rows(rows))
    if not _k._amx_reason:
        weights["amx-bf16"] = (_k._tiles(lib, exact[:16]), exact[:16].float())
        if "amx_int8" in _cpu_flags():
            weights["amx-int8"] = (_k._int8_tiles(lib, values[:16], scale[:16]), weights["int8"][1][:16])
        if "avx512_bf16" in _cpu_flags():  # what ``amx_blocks`` asks of the CPU besides AMX
            for kind, dtype in AMX_BLOCKS.items():
                raw = _random_blocks(kind, 16, 64, generator)
                tiled = torch.empty(16, 2 * FORMATS[dtype].columns, dtype=dtype)
                lib.pack_amx_blocks(raw.data_ptr(), tiled.data_ptr(), 16, 64, int(kind == "Q8_0"))
                weights[FORMATS[dtype].name] = (tiled, dequantize_blocks(kind, raw))
    return weights
