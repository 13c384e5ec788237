"""The kernel's AVX-512 loop beside its AVX2 loop: each weight format against float64, rows independent
of the other rows in the call, the two loops agreeing to rounding, widths that are not a multiple of 16
taking the AVX2 loop, and the switches (VERISPEC_AVX512=0, a failing self-check) with status() saying
which loop multiplies. On a CPU without AVX-512 the AVX-512 cases skip, saying so; the AVX2 loop's own
tests are in test_kernels.py (which on such a CPU run it) and through the ``kernel_path`` fixture."""

import pytest
import torch

from verispec import kernels

pytestmark = pytest.mark.skipif(kernels.library() is None, reason=f"kernel unavailable here: {kernels.status()}")
AVX512_ONLY = pytest.mark.skipif(not kernels.avx512(),
                                 reason=f"no AVX-512 loop here ({kernels._avx512_reason or 'kernel unavailable'})")


def _formats(out_features: int, in_features: int, seed: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Format name -> (packed weight, its float64 values) for every format of the two loops."""
    generator = torch.Generator().manual_seed(seed)
    fp32 = torch.randn(out_features, in_features, generator=generator)
    bf16 = torch.randn(out_features, in_features, generator=generator).to(torch.bfloat16)
    values, scale = kernels._int8_values(torch.randn(out_features, in_features, generator=generator))
    weights = {"fp32": (fp32, fp32.double()), "bf16": (bf16, bf16.double()),
               "int8": (kernels._int8_rows(values, scale), values.double() * scale.double())}
    if in_features % 32 == 0:
        for kind, dtype in kernels.BLOCK_FORMATS.items():
            raw = kernels._random_blocks(kind, out_features, in_features, generator)
            weights[kind] = (raw.view(dtype), kernels.dequantize_blocks(kind, raw).double())
    return weights


def _products(x: torch.Tensor, packed: torch.Tensor, avx512: bool) -> torch.Tensor:
    kernels.set_avx512(avx512)
    try:
        return kernels.linear(x, packed)
    finally:
        kernels.set_avx512(True)


@AVX512_ONLY
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 16])
@pytest.mark.parametrize("shape", [(13, 64), (37, 576), (96, 1536)])
def test_avx512_loop_matches_float64_with_rows_independent(rows, shape):
    """Every format on the AVX-512 loop: within fp32 rounding of the float64 product of the exact
    weight values, each row bit-identical alone and in the call, and close to the AVX2 loop's."""
    out_features, in_features = shape
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows))
    for name, (packed, values) in _formats(out_features, in_features, seed=rows).items():
        got = _products(x, packed, True)
        exact = x.double() @ values.T
        bound = 1e-5 * (x.double().abs() @ values.abs().T) + 1e-30
        assert bool(((got.double() - exact).abs() <= bound).all()), name
        for row in {0, rows // 2, rows - 1}:
            assert torch.equal(_products(x[row:row + 1], packed, True), got[row:row + 1]), (name, row)
        avx2 = _products(x, packed, False)
        assert bool(((avx2.double() - exact).abs() <= bound).all()), name


@AVX512_ONLY
def test_the_two_loops_sum_in_different_orders_and_widths_off_16_take_avx2():
    """A different lane count sums in a different order (so the loops are told apart by their bits);
    a width that is not a multiple of 16 runs the AVX2 loop even with AVX-512 on (the same bits)."""
    x = torch.randn(5, 576, generator=torch.Generator().manual_seed(1))
    weight = torch.randn(64, 576, generator=torch.Generator().manual_seed(2))
    assert not torch.equal(_products(x, weight, True), _products(x, weight, False))
    x, weight = x[:, :72].contiguous(), weight[:, :72].contiguous()  # K = 72: 8 | K, 16 does not
    assert torch.equal(_products(x, weight, True), _products(x, weight, False))


@AVX512_ONLY
def test_status_names_the_loop_in_use_and_switches():
    assert kernels.status().startswith(
        "available (avx512: fp32, bf16, int8, Q4_1, Q8_0, Q4_1 pairs (K % 16 == 0, else avx2)")
    kernels.set_avx512(False)
    try:
        assert kernels.status().startswith(
            "available (avx2: fp32, bf16, int8, Q4_1, Q8_0, Q4_1 pairs; AVX-512 off: switched off")
    finally:
        kernels.set_avx512(True)
    assert kernels.library().avx512_on() == 1


@AVX512_ONLY
def test_avx512_is_switched_off_by_environment(monkeypatch):
    kernels.library.cache_clear()
    monkeypatch.setenv("VERISPEC_AVX512", "0")
    try:
        assert kernels.library() is not None and not kernels.avx512()
        assert kernels.library().avx512_on() == 0 and not kernels.set_avx512(True)
        assert ("avx2: fp32, bf16, int8, Q4_1, Q8_0, Q4_1 pairs; AVX-512 off: disabled by VERISPEC_AVX512=0"
                in kernels.status())
    finally:
        monkeypatch.delenv("VERISPEC_AVX512")
        kernels.library.cache_clear()
    assert kernels.avx512() and kernels.library().avx512_on() == 1


@AVX512_ONLY
def test_an_avx512_loop_failing_the_self_check_leaves_the_avx2_loop(monkeypatch):
    """A product that disagrees only while the AVX-512 loop runs turns that loop off, with why; the
    AVX2 loop is then checked on its own and keeps every format."""
    real = kernels._product

    def wrong_on_avx512(lib, x, weight, bias, features):
        return real(lib, x, weight, bias, features) + float(lib.avx512_on() and weight.dtype == torch.bfloat16)
    kernels.library.cache_clear()
    monkeypatch.setattr(kernels, "_product", wrong_on_avx512)
    try:
        assert kernels.library() is not None and not kernels.avx512() and not kernels._failed
        assert kernels._avx512_reason.startswith("self-check failed: bf16 (off by up to 1")
        assert kernels.status().startswith(
            "available (avx2: fp32, bf16, int8, Q4_1, Q8_0, Q4_1 pairs; AVX-512 off: self-check")
    finally:
        monkeypatch.undo()
        kernels.library.cache_clear()
    assert kernels.avx512()


def test_without_avx512_the_reason_is_stated():
    """On every CPU: status() names the loop, and where AVX-512 is off it says why."""
    text = kernels.status()
    if kernels.avx512():
        assert text.startswith("available (avx512: ")
    else:
        assert text.startswith("available (avx2: ") and f"AVX-512 off: {kernels._avx512_reason}" in text
        assert kernels._avx512_reason
