"""GGUF blocks (Q4_1, Q8_0) tiled for AMX: the packing against the layout's reference, the fallback where
a Q4_1 weight d * q + m is not exact in fp32, products within fp32 rounding of float64 with each row's
bits independent of the other rows and of the threads, the switch (VERISPEC_AMX_BLOCKS=0) and a failing
self-check. On a CPU without AMX the product cases skip, saying so; the packing cases run wherever the
library was built with the AMX code (the packing itself is plain C)."""

import pytest
import torch

from verispec import kernels
from verispec.kernels.formats import AMX_BLOCKS, FORMATS, _random_blocks, dequantize_amx_blocks, dequantize_blocks
from verispec.kernels.packing import _amx_blocks, _pack_blocks

pytestmark = pytest.mark.skipif(kernels.library() is None, reason=f"kernel unavailable here: {kernels.status()}")
TILES_ONLY = pytest.mark.skipif(not kernels.amx_blocks(),
                                reason=f"GGUF blocks are not tiled for AMX here ({kernels.paths() if kernels.library() else ''}"
                                       f"{'; AMX off: ' + kernels._amx_reason if kernels._amx_reason else ''})")
KINDS = ("Q4_1", "Q8_0")


def _pack(kind: str, raw: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``pack_amx_blocks`` called directly: (tiled rows, how many Q4_1 weights are not exact in fp32)."""
    out_features, row_bytes = raw.shape
    dtype = AMX_BLOCKS[kind]
    blocks = row_bytes // kernels.block_bytes(kind)
    tiled = torch.empty(out_features, blocks * FORMATS[dtype].columns, dtype=dtype)
    inexact = kernels.library().pack_amx_blocks(raw.data_ptr(), tiled.data_ptr(), out_features, blocks * 32,
                                                int(kind == "Q8_0"))
    if inexact < 0:
        pytest.skip("the library was built without the AMX code (a compiler without AMX intrinsics)")
    return tiled, inexact


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", [(16, 32), (48, 96), (32, 576)])
def test_packing_keeps_every_weight_where_the_layout_says(kind, shape):
    raw = _random_blocks(kind, *shape, torch.Generator().manual_seed(shape[1]))
    tiled, inexact = _pack(kind, raw)
    assert inexact == 0
    assert torch.equal(dequantize_amx_blocks(tiled), dequantize_blocks(kind, raw))
    assert kernels.packed_inputs(tiled) == shape[1]


def _inexact_q4_1(out_features=16, in_features=64) -> torch.Tensor:
    """Q4_1 rows whose first block has d = 1024 and m = 2^-14: d * 15 + m needs 25 significant bits."""
    raw = _random_blocks("Q4_1", out_features, in_features, torch.Generator().manual_seed(3))
    raw[0, :4] = torch.tensor([1024.0, 2.0 ** -14], dtype=torch.float16).view(torch.uint8)
    raw[0, 4:20] = 0xFF  # every nibble 15
    return raw


def test_q4_1_rows_with_an_inexact_weight_are_not_tiled():
    raw = _inexact_q4_1()
    _, inexact = _pack("Q4_1", raw)
    assert inexact == 32  # the block's 32 weights, each 15 * 1024 + 2^-14
    assert _amx_blocks("Q4_1", raw) is None
    packed = _pack_blocks(dequantize_blocks("Q4_1", raw), "Q4_1", raw)  # the file's rows on the loops instead
    assert packed is not None and packed.dtype not in AMX_BLOCKS.values()


def _tiled(kind: str, out_features: int, in_features: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random GGUF rows tiled for AMX and their values; the first rows from ``seed`` on whose every Q4_1
    weight is exact in fp32 (random scales sometimes make d * q + m round; those rows are not tiled)."""
    generator = torch.Generator().manual_seed(seed)
    raw = _random_blocks(kind, out_features, in_features, generator)
    while _pack(kind, raw)[1]:
        raw = _random_blocks(kind, out_features, in_features, generator)
    values = dequantize_blocks(kind, raw)
    packed = kernels._pack_weight(values, (kind, raw))
    assert packed.dtype == AMX_BLOCKS[kind]
    return packed, values.double()


@TILES_ONLY
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 15, 16, 17, 33, 64, 65, 128])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", [(16, 32), (48, 96), (96, 1536)])
def test_tiles_match_float64_with_rows_independent(rows, kind, shape):
    """Within fp32 rounding of the float64 product of the dequantized values, each row bit-identical alone
    and in the call: chunks of 16 rows share unpacked tiles, but every row is summed in one order."""
    out_features, in_features = shape
    packed, values = _tiled(kind, out_features, in_features, seed=rows)
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_features, generator=generator) * torch.logspace(-3, 2, in_features)
    bias = torch.randn(out_features, generator=generator)
    got = kernels.linear(x, packed, bias)
    exact = x.double() @ values.T + bias.double()
    bound = 1e-5 * (x.double().abs() @ values.abs().T + bias.double().abs()) + 1e-30
    assert bool(((got.double() - exact).abs() <= bound).all())
    for row in {0, rows // 2, rows - 1}:
        assert torch.equal(kernels.linear(x[row:row + 1], packed, bias), got[row:row + 1]), row


@TILES_ONLY
def test_threads_split_outputs_without_changing_a_bit():
    packed, _ = _tiled("Q4_1", 96, 576, seed=1)
    x = torch.randn(7, 576, generator=torch.Generator().manual_seed(2))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernels.linear(x, packed)
        torch.set_num_threads(2)
        assert torch.equal(kernels.linear(x, packed), one)
    finally:
        torch.set_num_threads(threads)


@TILES_ONLY
def test_status_names_the_tiles_and_the_switch_keeps_the_loops(monkeypatch):
    assert "amx-Q4_1, amx-Q8_0" in kernels.paths()
    raw = _random_blocks("Q8_0", 32, 64, torch.Generator().manual_seed(4))
    linear = torch.nn.Linear(64, 32, bias=False)
    with torch.no_grad():
        linear.weight.copy_(dequantize_blocks("Q8_0", raw))
    linear.gguf_blocks = ("Q8_0", raw)
    kernels.accelerate(linear)
    assert "1 on Q8_0 blocks (1 on AMX tiles)" in kernels.status(linear)
    monkeypatch.setenv("VERISPEC_AMX_BLOCKS", "0")
    assert not kernels.amx_blocks() and "amx-Q4_1" not in kernels.paths()
    linear._pack()
    assert linear.packed.dtype == kernels.BLOCK_FORMATS["Q8_0"]
    assert "1 on Q8_0 blocks," in kernels.status(linear)


@TILES_ONLY
def test_tiles_failing_the_self_check_are_not_used(monkeypatch):
    real = kernels._product
    kernels.library.cache_clear()
    monkeypatch.setattr(kernels, "_product", lambda lib, x, weight, bias, features: real(lib, x, weight, bias, features)
                        + float(weight.dtype == AMX_BLOCKS["Q4_1"]))
    try:
        assert kernels.library() is not None
        assert set(kernels._failed) == {"amx-Q4_1"}
        assert "amx-Q8_0" in kernels.paths() and "self-check turned off amx-Q4_1" in kernels.paths()
        monkeypatch.setattr(kernels, "_product", real)
        raw = _random_blocks("Q4_1", 16, 64, torch.Generator().manual_seed(5))
        packed = kernels._pack_weight(dequantize_blocks("Q4_1", raw), ("Q4_1", raw))
        assert packed.dtype == kernels.PAIRS  # the AVX-512 loop's layout instead
    finally:
        monkeypatch.undo()
        kernels.library.cache_clear()
    assert kernels.library() is not None and not kernels._failed
