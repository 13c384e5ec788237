"""kernels/packing.py: the layout a weight is packed in (GGUF rows that hold it, bf16 when exact, else
fp32; AMX tiles where the CPU has them) and int8 rows for drafts. Tile order itself: test_kernels.py."""

import torch

from verispec import kernels
from verispec.kernels.formats import _random_blocks, dequantize_blocks, pair_blocks
from verispec.kernels.packing import _pack_blocks, _pack_weight, quantize_int8


def _bf16_exact(out_features, in_features, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(out_features, in_features, generator=generator).to(torch.bfloat16).float()


def test_a_weight_is_packed_as_bf16_only_where_that_loses_nothing():
    exact = _bf16_exact(24, 64)  # N % 16 != 0: row-major bf16 even where AMX tiles exist
    packed = _pack_weight(exact)
    assert packed.dtype == torch.bfloat16 and torch.equal(packed.float(), exact)
    inexact = exact.clone()
    inexact[3, 5] += 1e-3
    assert _pack_weight(inexact).dtype == torch.float32 and torch.equal(_pack_weight(inexact), inexact)
    whole_tiles = _pack_weight(_bf16_exact(32, 64))
    assert whole_tiles.dtype == (torch.int16 if kernels.amx() else torch.bfloat16)
    assert whole_tiles.shape == (32, 64)


def test_gguf_rows_are_used_only_where_they_hold_the_weight():
    generator = torch.Generator().manual_seed(0)
    for kind, dtype in kernels.BLOCK_FORMATS.items():
        raw = _random_blocks(kind, 8, 64, generator)
        values = dequantize_blocks(kind, raw)
        packed = _pack_blocks(values, kind, raw)
        if kind == "Q4_1" and kernels.avx512():  # K % 64 == 0: repacked in pairs, the same values
            assert packed.dtype == kernels.PAIRS and torch.equal(packed, pair_blocks(raw))
            dtype = kernels.PAIRS
        else:
            assert packed.dtype == dtype and torch.equal(packed.view(torch.uint8), raw)
        assert _pack_weight(values, (kind, raw)).dtype == dtype
        edited = values.clone()
        edited[7, 63] += 1.0
        assert _pack_blocks(edited, kind, raw) is None  # not the rows' values: the weight is packed instead
        assert _pack_blocks(values[:4], kind, raw) is None  # other rows
        assert _pack_blocks(values, kind, raw[:, :-1]) is None  # not whole blocks
        assert _pack_blocks(values.double(), kind, raw) is None
    raw = _random_blocks("Q8_0", 8, 64, generator)
    assert _pack_blocks(dequantize_blocks("Q8_0", raw), "Q4_K", raw) is None  # a format the kernel lacks
    raw = _random_blocks("Q4_1", 8, 96, generator)  # K % 64 != 0: the rows as stored on every loop
    assert _pack_blocks(dequantize_blocks("Q4_1", raw), "Q4_1", raw).dtype == torch.int32


def test_int8_rows_keep_each_weight_within_half_a_step():
    weight = torch.randn(8, 64, generator=torch.Generator().manual_seed(2))
    packed = quantize_int8(weight)  # N % 16 != 0: rows, not AMX-INT8 tiles, on every CPU
    assert packed.dtype == torch.int8 and packed.shape == (8, 68)
    scale = packed[:, :4].contiguous().view(torch.float32)  # (N, 1)
    torch.testing.assert_close(scale, weight.abs().amax(1, keepdim=True) / 127)
    error = (packed[:, 4:].float() * scale - weight).abs()
    assert (error <= scale / 2 + 1e-6).all()
