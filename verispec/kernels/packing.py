"""Weights packed as the kernel reads them: the layout a layer's weight takes (``_pack_weight``: GGUF rows,
bf16, AMX tiles or fp32), GGUF rows checked against the weight (``_pack_blocks``), int8 rows or tiles for
draft models (``quantize_int8``) and the block of memory a model's packed weights are gathered into
(``Arena``). Re-exported by ``verispec.kernels``; the package's names (``amx``, ``library``, ``_failed``,
...) are read through it (``_k``) at call time."""

from __future__ import annotations

import ctypes
import sys

import torch

from verispec import kernels as _k
from verispec.kernels.formats import (AMX_BLOCKS, BLOCK_FORMATS, FORMATS, Q4_K_BYTES, Q6_K_BYTES, _int8_rows,
                                      _int8_values, as_q8_0, block_bytes, dequantize_blocks, dequantize_pairs,
                                      dequantize_q6_k_rows, pair_blocks, q4_k_pairs, q6_k_rows)


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
    if _k.amx() and out_features % 16 == 0 and in_features % 32 == 0:
        return _tiles(_k.library(), as_bf16)
    return weight.contiguous() if "bf16" in _k._failed else as_bf16


def _tiles(lib: ctypes.CDLL, weight: torch.Tensor) -> torch.Tensor:
    """bf16 (N, K) contiguous -> the AMX tile order (``pack_amx``), as int16 (N, K)."""
    tiled = torch.empty(weight.shape, dtype=torch.int16)
    lib.pack_amx(weight.data_ptr(), tiled.data_ptr(), *weight.shape)
    return tiled


def _pack_blocks(weight: torch.Tensor, kind: str, raw: torch.Tensor) -> torch.Tensor | None:
    """GGUF rows for the kernel: ``raw`` uint8 (N, row bytes), row n the file's row for output n in one
    of BLOCK_FORMATS (``kind``: "Q4_1" or "Q8_0"; layouts in the C source at ``load_w_q4_1``), "Q4_0" /
    "Q5_0" (as Q8_0 rows, ``as_q8_0``) or "Q4_K" / "Q6_K" (repacked, see ``_k_quant_rows``), viewed as
    that format's dtype (Q4_1 int32 (N, K / 32 * 5), Q8_0 uint16 (N, K / 32 * 17)): no torch op reads
    them as numbers, and rows still cut and join like rows (q | k | v, gate | up). Where AMX multiplies GGUF
    blocks (``amx_blocks``) and N % 16 == 0, rows are tiled for it (``_amx_blocks``: the same values,
    verification of 1..16 rows at about the cost of one). Else, where the AVX-512 loop
    multiplies and K % 64 == 0, Q4_1 rows are repacked as "Q4_1 pairs" (``pair_blocks``, int64 (N, K / 64
    * 6)): the same values in 24 bytes a block instead of 20, which that loop multiplies faster. None, so the caller
    packs ``weight`` itself, unless K % 32 == 0, the format's self-check passed and the rows dequantize
    to exactly ``weight`` (a loader's row order mistake, or a weight edited in place, would otherwise
    make the kernel compute something else than torch's path)."""
    if kind in ("Q4_K", "Q6_K"):
        return _k_quant_rows(weight, kind, raw)
    if kind in ("Q4_0", "Q5_0") and raw.dtype == torch.uint8 and raw.dim() == 2 and \
            raw.shape[1] == weight.shape[1] // 32 * (18 if kind == "Q4_0" else 22) and weight.shape[1] % 32 == 0:
        kind, raw = "Q8_0", as_q8_0(kind, raw.detach())  # the same values as Q8_0 rows, checked below
    dtype = BLOCK_FORMATS.get(kind)
    out_features, in_features = weight.shape
    if dtype is None or kind in _k._failed or in_features % 32 or raw.dtype != torch.uint8 or raw.is_cuda \
            or weight.dtype != torch.float32 \
            or tuple(raw.shape) != (out_features, in_features // 32 * block_bytes(kind)):
        return None
    raw = raw.detach().contiguous()
    if raw.storage_offset() % dtype.itemsize:
        raw = raw.clone()
    if not _holds(lambda rows: dequantize_blocks(kind, rows), raw, weight):
        return None
    tiled = _amx_blocks(kind, raw) if out_features % 16 == 0 else None
    if tiled is not None:
        return tiled
    if kind == "Q4_1" and in_features % 64 == 0 and _k.avx512() and "Q4_1 pairs" not in _k._failed:
        return pair_blocks(raw)
    return raw.view(dtype)


def _k_quant_rows(weight: torch.Tensor, kind: str, raw: torch.Tensor) -> torch.Tensor | None:
    """GGUF K-quant rows (uint8 (N, K / 256 * super-block bytes)) repacked with the same values: Q4_K as "Q4_1
    pairs" (``q4_k_pairs``, 6 bits a weight instead of 4.5; AMX tiles hold fp16 scales only), Q6_K as "Q6_K
    rows" (``q6_k_rows``, 10 bits a weight instead of 6.6), on every loop; or None unless the format's
    self-check passed and the repacked rows dequantize to exactly ``weight``."""
    path, size, repack, values = (("Q4_1 pairs", Q4_K_BYTES, q4_k_pairs, dequantize_pairs) if kind == "Q4_K" else
                                  ("Q6_K rows", Q6_K_BYTES, q6_k_rows, dequantize_q6_k_rows))
    out_features, in_features = weight.shape
    if path in _k._failed or in_features % 256 or raw.dtype != torch.uint8 or raw.is_cuda \
            or weight.dtype != torch.float32 or tuple(raw.shape) != (out_features, in_features // 256 * size):
        return None
    packed = repack(raw.detach())
    return packed if _holds(values, packed, weight) else None


def _holds(values, rows: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``values(rows)`` (a format's dequantization) is exactly ``weight``, checked in slices of 4096
    rows so the check's float copies stay small."""
    return all(torch.equal(values(rows[first:first + 4096]), weight[first:first + 4096])
               for first in range(0, weight.shape[0], 4096))


def _amx_blocks(kind: str, raw: torch.Tensor) -> torch.Tensor | None:
    """GGUF rows (uint8 (N, row bytes), N % 16 == 0) tiled for AMX (``pack_amx_blocks`` in the C source) as
    that path's dtype (AMX_BLOCKS), where ``amx_blocks()`` and the path's self-check passed; None where
    not, or where a Q4_1 weight's d * q + m is not exact in fp32 (the tile path multiplies by d * q + m
    exactly, so only exact weights make it the same model)."""
    dtype = AMX_BLOCKS[kind]
    if not _k.amx_blocks() or FORMATS[dtype].name in _k._failed:
        return None
    out_features, row_bytes = raw.shape
    tiled = torch.empty(out_features, row_bytes // block_bytes(kind) * FORMATS[dtype].columns, dtype=dtype)
    inexact = _k.library().pack_amx_blocks(raw.data_ptr(), tiled.data_ptr(), out_features,
                                           row_bytes // block_bytes(kind) * 32, int(kind == "Q8_0"))
    return tiled if inexact == 0 else None


def quantize_int8(weight: torch.Tensor) -> torch.Tensor | None:
    """(N, K) float -> (N, K + 4) bytes for ``linear``: per output row, an fp32 scale (max |w| / 127) and
    the K values rounded to multiples of it. With AMX-INT8 (``amx_int8()``) and N % 16 == 0, K % 64 == 0:
    uint8, tiled by ``pack_amx_i8`` (the C source; input rows are then quantised too, per row); else
    int8 rows, each its scale's 4 bytes then its values (the AVX2 loop, for up to INT8_ROWS rows), or
    None where the self-check turned int8 rows off. For draft models only: what a draft proposes
    decides acceptance, never the committed distribution."""
    values, scale = _int8_values(weight)
    out_features, in_features = weight.shape
    if _k.amx_int8() and out_features % 16 == 0 and in_features % 64 == 0:
        return _int8_tiles(_k.library(), values, scale)
    return None if "int8" in _k._failed else _int8_rows(values, scale)


def _int8_tiles(lib: ctypes.CDLL, values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """int8 values (N, K) and their row scales -> the AMX-INT8 tile order (``pack_amx_i8``), as uint8 (N, K + 4)."""
    tiled = torch.empty(values.shape[0], values.shape[1] + 4, dtype=torch.uint8)
    scales = scale.reshape(-1).contiguous()
    lib.pack_amx_i8(values.data_ptr(), scales.data_ptr(), tiled.data_ptr(), *values.shape)
    return tiled


HUGE_PAGE = 2 << 20  # bytes of a transparent huge page on x86-64 Linux
MADV_HUGEPAGE = 14  # <sys/mman.h>


def advise_huge_pages(address: int, length: int) -> bool:
    """Ask Linux to back [address, address + length) with transparent huge pages (``madvise``); False
    where that is not Linux or the call failed. Needed where THP is in "madvise" mode (the common
    default): torch's allocations are then on 4 KiB pages. Advice only: memory is the same either way."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        return libc.madvise(address, length, MADV_HUGEPAGE) == 0
    except (OSError, AttributeError):
        return False


class Arena:
    """One block of ``nbytes`` for a model's packed weights, 2 MiB aligned and advised as huge pages
    (before anything is written, so the pages are huge when first touched). ``cat`` places tensors
    one after another at 64-byte boundaries, in the order a pass reads them. A decode step then
    reads one stream of huge pages instead of hundreds of separate allocations on 4 KiB pages."""

    ALIGN = 64

    def __init__(self, nbytes: int):
        self.buffer = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)
        self.offset = (-self.buffer.data_ptr()) % HUGE_PAGE
        self.end = self.offset + nbytes
        self.huge = advise_huge_pages(self.buffer.data_ptr() + self.offset, -(-nbytes // 4096) * 4096)

    @classmethod
    def size(cls, tensors) -> int:
        """Bytes ``cat`` takes for these tensors (each call's tensors together)."""
        total = sum(t.numel() * t.element_size() for t in tensors)
        return -(-total // cls.ALIGN) * cls.ALIGN

    def cat(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """``torch.cat(parts)`` (along dim 0, one dtype) written into the block."""
        dtype, tail = parts[0].dtype, tuple(parts[0].shape[1:])
        nbytes = sum(p.numel() for p in parts) * parts[0].element_size()
        if self.offset + nbytes > self.end or any(p.dtype != dtype or tuple(p.shape[1:]) != tail for p in parts):
            raise ValueError("arena: parts of mixed dtypes or shapes, or more bytes than it was sized for")
        out = self.buffer[self.offset:self.offset + nbytes].view(dtype).view(-1, *tail)
        first = 0
        for part in parts:
            out[first:first + part.shape[0]].copy_(part)
            first += part.shape[0]
        self.offset += self.size([out])
        return out
