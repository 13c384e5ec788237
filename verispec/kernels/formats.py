"""The weight formats the kernel multiplies (``FORMATS``, told by a packed tensor's dtype) and the pure
helpers on them: a packed weight's input width, GGUF block sizes and their exact dequantization, random
blocks and int8 rows for the load-time self-check. Re-exported by ``verispec.kernels``."""

from __future__ import annotations

from typing import NamedTuple

import torch


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
    torch.int64: Format(7, "Q4_1 pairs", 6, 64, 0, 1, 64),  # Q4_1 rows repacked (``pair_blocks``), 48 bytes per 64
    # tiled for AMX (``pack_amx_blocks``), 20 bytes per 32: raw bytes a float8 dtype only tells apart
    torch.float8_e4m3fn: Format(8, "amx-Q4_1", 20, 32, 0, 16, 32),
    torch.uint32: Format(9, "amx-Q8_0", 9, 32, 0, 16, 32),  # tiled for AMX (``pack_amx_blocks``), 36 bytes per 32
    torch.float8_e5m2: Format(10, "Q6_K rows", 40, 32, 0, 1, 32),  # Q6_K rows repacked (``q6_k_rows``), 40 bytes per 32
}


WEIGHT_TYPES = {dtype: form.wtype for dtype, form in FORMATS.items()}  # C's wtype


# A GGUF file's own row formats: "Q4_1" -> int32, "Q8_0" -> uint16
BLOCK_FORMATS = {form.name: dtype for dtype, form in FORMATS.items() if form.name in ("Q4_1", "Q8_0")}
PAIRS = torch.int64  # the "Q4_1 pairs" dtype: a GGUF file's Q4_1 rows as the AVX-512 loop reads them best
Q6_K_ROWS = torch.float8_e5m2  # the "Q6_K rows" dtype: raw bytes a float8 dtype only tells apart
AMX_BLOCKS = {"Q4_1": torch.float8_e4m3fn, "Q8_0": torch.uint32}  # GGUF rows tiled for AMX, by the file's format
# packed weights that hold a GGUF file's values
GGUF_DTYPES = (*BLOCK_FORMATS.values(), PAIRS, *AMX_BLOCKS.values(), Q6_K_ROWS)


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
    values = torch.empty(*qs.shape[:-1], 32)  # low nibbles then high ones, written in place: no uint8 copies
    torch.bitwise_and(qs, 15, out=values[..., :16])
    torch.bitwise_right_shift(qs, 4, out=values[..., 16:])
    return values.mul_(d).add_(m).reshape(raw.shape[0], -1)


# Random GGUF rows (``_random_blocks``), per format: bytes and weights a block, where its fp16 scales start and
# how many, and their range as (shift, span): uniform over (-shift * span, (1 - shift) * span).
_RANDOM_LAYOUTS = {"Q4_1": (20, 32, 0, 2, 0.25, 0.1), "Q8_0": (34, 32, 0, 1, 0.25, 0.1),
                   "Q4_K": (144, 256, 0, 2, -0.05, 2e-3), "Q6_K": (210, 256, 208, 1, -0.02, 5e-4)}


def _random_blocks(kind: str, out_features: int, in_features: int, generator: torch.Generator) -> torch.Tensor:
    """Random GGUF rows (uint8 (N, row bytes)) of ``kind`` (Q4_1, Q8_0, Q4_K or Q6_K) with finite scales, for
    the self-check and tests (gguf-py has no K-quant quantizer): any other bytes (K-quants: positive d, dmin;
    values within about +-2)."""
    size, weights, at, headers, shift, span = _RANDOM_LAYOUTS[kind]
    raw = torch.randint(0, 256, (out_features, in_features // weights, size), dtype=torch.uint8,
                        generator=generator)
    scales = (torch.rand(out_features, in_features // weights, headers, generator=generator) - shift) * span
    raw[..., at:at + 2 * headers] = scales.half().view(torch.uint8)
    return raw.reshape(out_features, -1)


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


def pair_blocks(raw: torch.Tensor) -> torch.Tensor:
    """Q4_1 rows (uint8 (N, K / 32 * 20), K % 64 == 0) -> the same weights as "Q4_1 pairs" (int64 (N, K / 64 * 6)),
    the layout ``load16_q4_1_pairs`` in the C source reads: per two consecutive blocks, their d0, d1, m0, m1
    as fp32 (exact conversions of the fp16 scales), then 16 uint16 lanes, lane i the first block's qs[i] in
    its low byte and the second block's in its high byte."""
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, 2, 20)
    scales = blocks[..., :4].contiguous().view(torch.float16).float()  # (N, pairs, 2, [d, m])
    header = scales.transpose(-1, -2).reshape(rows, -1, 4).contiguous().view(torch.uint8)  # d0, d1, m0, m1
    lanes = blocks[..., 4:].transpose(-1, -2).reshape(rows, -1, 32)  # qs0[0], qs1[0], qs0[1], ...
    return torch.cat([header, lanes], dim=-1).reshape(rows, -1).contiguous().view(torch.int64)


Q4_K_BYTES = 144  # a GGUF Q4_K super-block: fp16 d and dmin, 12 bytes of 6-bit scales and mins, 128 of nibbles


def q4_k_pairs(raw: torch.Tensor) -> torch.Tensor:
    """GGUF Q4_K rows (uint8 (N, K / 256 * 144)) -> "Q4_1 pairs" rows (``pair_blocks``) of the same values.

    A Q4_K super-block holds 8 blocks of 32 weights, block j valued d * sc[j] * q - dmin * m[j] (sc, m 6-bit
    integers; gguf-py rounds once: d * sc, d * sc * q and dmin * m are exact in fp32). That is a Q4_1 block
    with the fp32 scale d * sc[j] and offset -dmin * m[j], which the pairs store as fp32: the kernel's one
    fused multiply-add per weight gives the file's value. Blocks 2c and 2c + 1 share qs[32c .. 32c + 31] (low
    and high nibbles) and become one pair."""
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, Q4_K_BYTES)  # (N, S, 144)
    d = blocks[..., 0:2].contiguous().view(torch.float16).float()  # (N, S, 1)
    dmin = blocks[..., 2:4].contiguous().view(torch.float16).float()
    packed = blocks[..., 4:16].long()
    low, high, mixed = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = torch.cat([low & 63, (mixed & 15) | ((low >> 6) << 4)], dim=-1).float()  # (N, S, 8)
    mins = torch.cat([high & 63, (mixed >> 4) | ((high >> 6) << 4)], dim=-1).float()
    scale, offset = d * sc, -(dmin * mins)  # both exact
    qs = blocks[..., 16:].reshape(rows, -1, 4, 32)  # (N, S, chunk, 32): block 2c low nibbles, 2c + 1 high
    first = (qs[..., :16] & 15) | ((qs[..., 16:] & 15) << 4)  # block 2c as a Q4_1 block's 16 bytes
    second = (qs[..., :16] >> 4) | (qs[..., 16:] & 0xF0)  # block 2c + 1
    header = torch.stack([scale[..., 0::2], scale[..., 1::2], offset[..., 0::2], offset[..., 1::2]], dim=-1)
    header = header.contiguous().view(torch.uint8)  # (N, S, 4, 16): d0, d1, m0, m1 per pair
    lanes = torch.stack([first, second], dim=-1).reshape(rows, -1, 4, 32)  # byte 2i, 2i + 1: lane i
    return torch.cat([header, lanes], dim=-1).reshape(rows, -1).contiguous().view(torch.int64)


def as_q8_0(kind: str, raw: torch.Tensor) -> torch.Tensor:
    """GGUF Q4_0 or Q5_0 rows (uint8 (N, K / 32 * 18 or 22)) -> Q8_0 rows (uint8 (N, K / 32 * 34)) of the same
    values: both are d * (q - 8) or d * (q - 16) with an fp16 d and a 4- or 5-bit q, which Q8_0 holds as its d
    and an int8 (d * q exact in fp32 either way, as gguf-py computes it)."""
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, 18 if kind == "Q4_0" else 22)
    qs = blocks[..., -16:]
    q = torch.cat([qs & 15, qs >> 4], dim=-1).to(torch.int16)  # weights 0..15 low nibbles, 16..31 high
    if kind == "Q5_0":
        high = blocks[..., 2:6].contiguous().view(torch.int32)  # bit j: weight j's fifth bit
        q |= ((high >> torch.arange(32, dtype=torch.int32)) & 1).to(torch.int16) << 4
    q = (q - (8 if kind == "Q4_0" else 16)).to(torch.int8)
    return torch.cat([blocks[..., :2], q.view(torch.uint8)], dim=-1).reshape(rows, -1)


Q6_K_BYTES = 210  # a GGUF Q6_K super-block: 128 bytes of low 4 bits, 64 of high 2 bits, 16 int8 scales, fp16 d


def q6_k_rows(raw: torch.Tensor) -> torch.Tensor:
    """GGUF Q6_K rows (uint8 (N, K / 256 * 210)) -> "Q6_K rows" (float8_e5m2-held bytes (N, K / 32 * 40)) of
    the same values: per 32 weights the fp32 scales of its two halves (d * sc, exact: an fp16 times an int8),
    then the 32 weights' q - 32 as int8. gguf-py's value is (d * sc) * (q - 32) rounded once in float32,
    which is what the kernel's one multiply gives."""
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, Q6_K_BYTES)  # uint8 throughout: no wide copy of a large matrix
    low, high = blocks[..., :128].reshape(rows, -1, 2, 64), blocks[..., 128:192].reshape(rows, -1, 2, 32)
    sc = blocks[..., 192:208].contiguous().view(torch.int8).float()  # (N, S, 16)
    d = blocks[..., 208:210].contiguous().view(torch.float16).float()  # (N, S, 1)
    # 128 weights per half h: 4 quarters of 32, quarter j low bits from low[h][32 (j % 2) ..] >> 4 (j // 2),
    # high bits from high[h] >> 2 j
    quarters = [((low[..., 32 * (j % 2):32 * (j % 2) + 32] >> (4 * (j // 2))) & 15)
                | (((high >> (2 * j)) & 3) << 4) for j in range(4)]
    q = (torch.stack(quarters, dim=-2).to(torch.int8) - 32).reshape(rows, -1, 8, 32)  # (N, S, 8 blocks, 32)
    scales = (d * sc).reshape(rows, -1, 8, 2).contiguous().view(torch.uint8)  # (N, S, 8, 8 bytes)
    packed = torch.cat([scales, q.view(torch.uint8)], dim=-1)  # (N, S, 8, 40)
    return packed.reshape(rows, -1).contiguous().view(Q6_K_ROWS)


def dequantize_q6_k_rows(packed: torch.Tensor) -> torch.Tensor:
    """"Q6_K rows" (``q6_k_rows``) -> float32 (N, K): scale * q, one rounding as gguf-py's."""
    rows = packed.shape[0]
    blocks = packed.view(torch.uint8).reshape(rows, -1, 40)
    scales = blocks[..., :8].contiguous().view(torch.float32)  # (N, B, 2)
    q = blocks[..., 8:].contiguous().view(torch.int8).reshape(rows, -1, 2, 16).float()
    return (scales[..., None] * q).reshape(rows, -1)


def _random_q6_k_rows(out_features: int, in_features: int, generator: torch.Generator) -> torch.Tensor:
    """Random "Q6_K rows" (K % 32 == 0) as ``q6_k_rows`` makes them (fp16 * int8 scales, q in -32..31), for
    the self-check."""
    blocks = in_features // 32
    d = (torch.rand(out_features, blocks, 2, generator=generator) * 1e-3).half().float()
    sc = torch.randint(-128, 128, (out_features, blocks, 2), generator=generator).float()
    q = torch.randint(-32, 32, (out_features, blocks, 32), generator=generator).to(torch.int8)
    packed = torch.cat([(d * sc).contiguous().view(torch.uint8), q.view(torch.uint8)], dim=-1)
    return packed.reshape(out_features, -1).contiguous().view(Q6_K_ROWS)


def dequantize_pairs(packed: torch.Tensor) -> torch.Tensor:
    """"Q4_1 pairs" rows (``pair_blocks``) -> float32 (N, K): the values of the Q4_1 rows they came from."""
    rows = packed.shape[0]
    pairs = packed.view(torch.uint8).reshape(rows, -1, 48)
    header = pairs[..., :16].contiguous().view(torch.float32)  # (N, pairs, 4)
    lanes = pairs[..., 16:].reshape(rows, -1, 16, 2).transpose(-1, -2)  # (N, pairs, block, 16 bytes)
    q = torch.cat([lanes & 15, lanes >> 4], dim=-1).float()  # (N, pairs, block, 32)
    d, m = header[..., 0:2, None], header[..., 2:4, None]
    return (d * q + m).reshape(rows, -1)


def dequantize_amx_blocks(packed: torch.Tensor) -> torch.Tensor:
    """GGUF rows tiled for AMX (``pack_amx_blocks`` in the C source: "amx-Q4_1" (float8-held bytes) or
    "amx-Q8_0" uint32 (N, ...)) -> float32 (N, K): d * q + m (Q4_1) or d * q (Q8_0), each rounded once to
    fp32 as ``dequantize_blocks`` rounds them. A record: Q8_0 d[16] fp32 and 512 int8; Q4_1 d[16] and
    m[16] fp16 and 256 bytes of nibbles."""
    q8 = packed.dtype == AMX_BLOCKS["Q8_0"]
    rows, record = packed.shape[0], 576 if q8 else 320
    records = packed.view(torch.uint8).reshape(rows // 16, -1, record)  # (N / 16, K / 32, record)
    if q8:
        d = records[..., :64].contiguous().view(torch.float32)  # (N / 16, K / 32, 16)
        words = records[..., 64:].contiguous().view(torch.int8).reshape(*records.shape[:2], 16, 32).double()
        offset = torch.zeros_like(d)
    else:
        d = records[..., :32].contiguous().view(torch.float16).float()
        offset = records[..., 32:64].contiguous().view(torch.float16).float()
        nibbles = records[..., 64:].reshape(*records.shape[:2], 8, 32)  # byte i of row pair t
        words = torch.stack([nibbles & 15, nibbles >> 4], dim=-2).reshape(*records.shape[:2], 16, 32).double()
    # word i of tile row kk: output n = i // 2, input 2 kk + i % 2 of the chunk
    q = words.reshape(*records.shape[:2], 16, 16, 2).permute(0, 3, 1, 2, 4)  # (N / 16, n, K / 32, kk, j)
    values = d.permute(0, 2, 1)[..., None, None].double() * q + offset.permute(0, 2, 1)[..., None, None].double()
    return values.float().reshape(rows, -1)
