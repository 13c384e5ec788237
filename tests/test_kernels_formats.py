"""kernels/formats.py: a packed weight's input width per format, GGUF block sizes and their exact
dequantization (hand-built blocks), and the int8 rows' layout. Pure tensor code: no kernel needed."""

import pytest
import torch

from verispec.kernels.formats import (AMX_BLOCKS, BLOCK_FORMATS, FORMATS, GGUF_DTYPES, PAIRS, Q6_K_ROWS,
                                      _int8_rows, _int8_values, _random_blocks, as_q8_0,
                                      block_bytes, dequantize_amx_blocks, dequantize_blocks, dequantize_pairs,
                                      dequantize_q6_k_rows, packed_inputs, pair_blocks, q4_k_pairs, q6_k_rows)


def test_formats_are_told_apart_by_dtype():
    assert [form.name for form in FORMATS.values()] == ["fp32", "bf16", "amx-bf16", "int8", "amx-int8", "Q4_1", "Q8_0",
                                                        "Q4_1 pairs", "amx-Q4_1", "amx-Q8_0", "Q6_K rows"]
    assert sorted(form.wtype for form in FORMATS.values()) == list(range(11))  # the C source's weight types
    assert BLOCK_FORMATS == {"Q4_1": torch.int32, "Q8_0": torch.uint16}  # a GGUF file's rows as stored
    assert AMX_BLOCKS == {"Q4_1": torch.float8_e4m3fn, "Q8_0": torch.uint32}  # the same rows tiled for AMX
    assert GGUF_DTYPES == (torch.int32, torch.uint16, PAIRS, torch.float8_e4m3fn, torch.uint32, Q6_K_ROWS)
    assert FORMATS[PAIRS].name == "Q4_1 pairs"
    assert block_bytes("Q4_1") == 20 and block_bytes("Q8_0") == 34  # fp16 d (and m), then 16 or 32 bytes


@pytest.mark.parametrize("dtype, columns", [
    (torch.float32, 64), (torch.bfloat16, 64), (torch.int16, 64),
    (torch.int8, 68), (torch.uint8, 68),  # an fp32 scale's 4 bytes, then the values
    (torch.int32, 10), (torch.uint16, 34),  # two GGUF blocks of 32 weights: 2 * 20 bytes, 2 * 34 bytes
    (torch.int64, 6),  # one Q4_1 pair: 48 bytes
    (torch.float8_e4m3fn, 40), (torch.uint32, 18),  # two blocks tiled for AMX: 2 * 20 bytes, 2 * 36 bytes
    (torch.float8_e5m2, 80),  # two blocks of Q6_K rows: 2 * (2 fp32 scales + 32 int8)
])
def test_packed_inputs_of_each_format(dtype, columns):
    assert packed_inputs(torch.zeros(16, columns, dtype=dtype)) == 64


def test_packed_inputs_refuses_what_no_format_can_be():
    with pytest.raises(ValueError, match=r"not a packed weight for the kernel: torch.float64 of shape \(4, 8\)"):
        packed_inputs(torch.zeros(4, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="not a packed weight"):
        packed_inputs(torch.zeros(8))
    with pytest.raises(ValueError, match=r"a fp32 weight of \(4, 12\) .* multiple of 8 inputs"):
        packed_inputs(torch.zeros(4, 12))
    with pytest.raises(ValueError, match="amx-bf16 weight .* multiple of 32 inputs"):
        packed_inputs(torch.zeros(8, 32, dtype=torch.int16))  # tiles need N % 16 == 0
    with pytest.raises(ValueError, match="Q8_0 weight"):
        packed_inputs(torch.zeros(4, 33, dtype=torch.uint16))  # not whole blocks
    with pytest.raises(ValueError, match="int8 weight"):
        packed_inputs(torch.zeros(4, 4, dtype=torch.int8))  # a scale and no values
    with pytest.raises(ValueError, match="amx-Q4_1 weight"):
        packed_inputs(torch.zeros(8, 20, dtype=torch.uint8).view(torch.float8_e4m3fn))  # tiles of 16 rows


def _half_bytes(value: float) -> torch.Tensor:
    return torch.tensor([value], dtype=torch.float16).view(torch.uint8)


def test_q8_0_block_is_d_times_its_int8_values():
    q = torch.arange(-16, 16, dtype=torch.int8)
    row = torch.cat([_half_bytes(0.5), q.view(torch.uint8)])  # one block: d, then 32 int8 values
    values = dequantize_blocks("Q8_0", row[None])
    torch.testing.assert_close(values, 0.5 * q.float()[None], rtol=0, atol=0)


def test_q4_1_block_is_d_times_its_nibbles_plus_m():
    q = torch.tensor([(3 * i) % 16 for i in range(32)], dtype=torch.uint8)
    packed = q[:16] | (q[16:] << 4)  # weight j in the low nibble of byte j, weight j + 16 in the high one
    row = torch.cat([_half_bytes(0.25), _half_bytes(-1.0), packed, _half_bytes(2.0), _half_bytes(0.0), packed])
    values = dequantize_blocks("Q4_1", row[None])
    want = torch.cat([0.25 * q.float() - 1.0, 2.0 * q.float()])
    torch.testing.assert_close(values, want[None], rtol=0, atol=0)


def test_a_q4_1_pair_holds_both_blocks_scales_as_fp32_then_their_bytes_interleaved():
    q = torch.tensor([(3 * i) % 16 for i in range(32)], dtype=torch.uint8)
    first, second = q[:16] | (q[16:] << 4), (15 - q[:16]) | ((15 - q[16:]) << 4)
    row = torch.cat([_half_bytes(0.25), _half_bytes(-1.0), first, _half_bytes(2.0), _half_bytes(0.5), second])
    pair = pair_blocks(row[None])
    assert pair.dtype == torch.int64 and pair.shape == (1, 6)
    raw = pair.view(torch.uint8)[0]
    assert raw[:16].view(torch.float32).tolist() == [0.25, 2.0, -1.0, 0.5]  # d0, d1, m0, m1
    assert torch.equal(raw[16::2], first) and torch.equal(raw[17::2], second)  # lane i: first[i] | second[i] << 8
    want = torch.cat([0.25 * q.float() - 1.0, 2.0 * (15 - q.float()) + 0.5])
    torch.testing.assert_close(dequantize_pairs(pair), want[None], rtol=0, atol=0)


def test_pairs_dequantize_to_the_q4_1_rows_values():
    generator = torch.Generator().manual_seed(1)
    raw = _random_blocks("Q4_1", 7, 576, generator)  # 9 pairs a row
    pairs = pair_blocks(raw)
    assert pairs.shape == (7, 54) and packed_inputs(pairs) == 576
    assert torch.equal(dequantize_pairs(pairs), dequantize_blocks("Q4_1", raw))


def test_random_blocks_have_finite_scales_and_whole_rows():
    generator = torch.Generator().manual_seed(0)
    for kind in BLOCK_FORMATS:
        raw = _random_blocks(kind, 5, 96, generator)
        assert raw.shape == (5, 3 * block_bytes(kind)) and raw.dtype == torch.uint8
        values = dequantize_blocks(kind, raw)
        assert values.shape == (5, 96) and torch.isfinite(values).all()
        assert packed_inputs(raw.view(BLOCK_FORMATS[kind])) == 96


def test_int8_rows_hold_their_scale_then_values():
    weight = torch.tensor([[1.0, -2.0, 0.5, 127.0], [0.0, 0.0, 0.0, 0.0]])
    values, scale = _int8_values(weight)
    assert values.dtype == torch.int8 and values.tolist() == [[1, -2, 0, 127], [0, 0, 0, 0]]  # 0.5 rounds to even
    assert scale[0].item() == 1.0 and scale[1].item() > 0  # an all-zero row still has a usable scale
    rows = _int8_rows(values, scale)
    assert rows.shape == (2, 8)
    assert rows[:, :4].contiguous().view(torch.float32).flatten().tolist() == scale.flatten().tolist()
    assert torch.equal(rows[:, 4:], values)
    spread = torch.randn(3, 16, generator=torch.Generator().manual_seed(1))
    values, scale = _int8_values(spread)
    assert values.abs().max() == 127
    assert ((values.float() * scale - spread).abs() <= scale / 2 + 1e-7).all()  # rounded to the nearest step


def _amx_record(values: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None) -> torch.Tensor:
    """One AMX record by the layout's definition (small_m_linear.c, "AMX for GGUF blocks"): 16 outputs' d
    as fp32 (Q8_0), or d and m as fp16 (Q4_1), then the 512 values of 16 x 32 inputs, word i of tile row kk being output i // 2 and
    input 2 kk + i % 2; Q4_1 packs tile rows 2t and 2t + 1 as the low and high nibbles of bytes 32t + i."""
    words = torch.empty(16, 32, dtype=torch.int64)
    for kk in range(16):
        for i in range(32):
            words[kk, i] = values[i // 2, 2 * kk + i % 2]
    if m is None:
        body = words.to(torch.int8).view(torch.uint8).reshape(-1)
        return torch.cat([d.float().view(torch.uint8), body])
    body = (words[0::2] | (words[1::2] << 4)).to(torch.uint8).reshape(-1)
    return torch.cat([d.view(torch.uint8), m.view(torch.uint8), body])


def test_amx_tiles_dequantize_as_their_layout_says():
    """A hand-built record of each format: its values come back as d * q + m (Q4_1) or d * q (Q8_0), at
    the output and input the layout assigns, the 16 outputs' records one block after another."""
    generator = torch.Generator().manual_seed(5)
    d = torch.rand(16, generator=generator).half() + 0.5
    m = -torch.rand(16, generator=generator).half()
    nibbles = torch.randint(0, 16, (16, 32), generator=generator)
    record = _amx_record(nibbles, d, m)
    assert record.numel() == 320 and 320 == 16 * 20  # 20 bytes per block of 32 weights, as in the file
    packed = record.view(torch.float8_e4m3fn).reshape(16, 20)
    expected = d.float()[:, None] * nibbles.float() + m.float()[:, None]
    assert torch.equal(dequantize_amx_blocks(packed), expected)
    q8 = torch.randint(-128, 128, (16, 32), generator=generator)
    record = _amx_record(q8, d, None)
    assert record.numel() == 576 and 576 == 16 * 36
    assert torch.equal(dequantize_amx_blocks(record.view(torch.uint32).reshape(16, 9)), d.float()[:, None] * q8.float())
    q8 = q8.clamp(-127)  # so that -q8 is an int8 too
    two = torch.cat([_amx_record(q8, d, None), _amx_record(-q8, d, None)])  # chunks c = 0, 1 of block 0
    values = dequantize_amx_blocks(two.view(torch.uint32).reshape(16, 18))
    assert torch.equal(values[:, 32:], -values[:, :32])


def test_k_quants_repack_to_the_values_gguf_py_gives():
    """Q4_K rows as Q4_1 pairs with fp32 scales and Q6_K rows as int8 with fp32 scales per 16 weights hold
    exactly the values of gguf-py's dequantizer (d * sc * q - dmin * m; d * sc * (q - 32), one rounding)."""
    gguf = pytest.importorskip("gguf")
    from gguf.quants import dequantize
    generator = torch.Generator().manual_seed(0)
    raw = _random_blocks("Q4_K", 6, 512, generator)
    raw[0, :4] = 0  # d = dmin = 0
    want = torch.from_numpy(dequantize(raw.numpy(), gguf.GGMLQuantizationType.Q4_K).reshape(6, 512).copy())
    assert torch.equal(dequantize_pairs(q4_k_pairs(raw)), want)
    raw = _random_blocks("Q6_K", 6, 512, generator)
    want = torch.from_numpy(dequantize(raw.numpy(), gguf.GGMLQuantizationType.Q6_K).reshape(6, 512).copy())
    packed = q6_k_rows(raw)
    assert packed.dtype == Q6_K_ROWS and packed_inputs(packed) == 512
    assert torch.equal(dequantize_q6_k_rows(packed), want)


@pytest.mark.parametrize("kind", ["Q4_0", "Q5_0"])
def test_q4_0_and_q5_0_rows_are_q8_0_rows_of_the_same_values(kind):
    gguf = pytest.importorskip("gguf")
    from gguf.quants import dequantize, quantize
    weight = torch.randn(7, 96, generator=torch.Generator().manual_seed(1)).numpy()
    weight[2, :32] = 0.0  # d = 0
    raw = torch.from_numpy(quantize(weight, getattr(gguf.GGMLQuantizationType, kind)).copy()).view(torch.uint8)
    want = torch.from_numpy(dequantize(raw.numpy(), getattr(gguf.GGMLQuantizationType, kind)).reshape(7, 96).copy())
    assert torch.equal(dequantize_blocks("Q8_0", as_q8_0(kind, raw)), want)
