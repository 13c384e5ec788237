"""GGUF block weights (Q4_1, Q8_0) in the few-row kernel: products by exactly the values gguf-py's
dequantizer gives, row results independent of the other rows, the fallbacks where blocks do not hold
a layer's weight, and a model on block weights giving torch's logits through the per-op, fused and
one-call paths."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from verispec import kernels
from verispec.kernels.formats import _random_blocks
from verispec.models.llama import LlamaConfig, LlamaForCausalLM

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize, quantize  # noqa: E402

pytestmark = pytest.mark.skipif(kernels.library() is None,
                                reason=f"kernel unavailable here: {kernels.status()}")

KINDS = ("Q4_1", "Q8_0")


def _dtype(kind: str, in_features: int, out_features: int = 16) -> torch.dtype:
    """The packed dtype ``_pack_weight`` gives a layer's GGUF rows on this CPU (for rows whose Q4_1 weights
    are exact in fp32, as gguf-py's quantizer makes them here): tiles where GGUF blocks are tiled for AMX
    and N % 16 == 0, else Q4_1 rows in pairs where the AVX-512 loop multiplies and K % 64 == 0, else the
    rows as stored."""
    if kernels.amx_blocks() and out_features % 16 == 0:
        return kernels.AMX_BLOCKS[kind]
    if kind == "Q4_1" and in_features % 64 == 0 and kernels.avx512():
        return kernels.PAIRS
    return kernels.BLOCK_FORMATS[kind]


def _blocks(weight: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 GGUF rows of ``weight`` quantized by gguf-py, their values by gguf-py's dequantizer)."""
    qtype = getattr(gguf.GGMLQuantizationType, kind)
    raw = quantize(weight.detach().numpy().astype(np.float32), qtype)
    values = dequantize(raw, qtype).reshape(weight.shape)
    return torch.from_numpy(np.ascontiguousarray(raw)).view(torch.uint8), torch.from_numpy(values.copy())


def _packed(kind, out_features=38, in_features=96, seed=0):
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=generator) * torch.logspace(-2, 1, in_features)
    weight[1] = 0.0  # a block of zeros: d = 0
    raw, values = _blocks(weight, kind)
    packed = kernels._pack_weight(values, (kind, raw))
    assert packed.dtype == _dtype(kind, in_features, out_features)
    return packed, values, raw


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 7, 8, 16])
@pytest.mark.parametrize("shape", [(38, 96), (384, 256), (40, 1088)])
@pytest.mark.parametrize("kind", KINDS)
def test_blocks_multiply_by_the_dequantized_values(kind, shape, rows):
    packed, values, raw = _packed(kind, *shape, seed=rows)
    assert torch.equal(kernels.dequantize_blocks(kind, raw), values)  # the same numbers as gguf-py's
    x = torch.randn(rows, shape[1], generator=torch.Generator().manual_seed(1))
    bias = torch.randn(shape[0])
    for with_bias in (None, bias):
        got = kernels.linear(x, packed, with_bias)
        want = x.double() @ values.double().T + (0 if with_bias is None else with_bias.double())
        scale = (x.double().abs() @ values.double().abs().T).max()
        torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-6 * float(scale))
        torch.testing.assert_close(got, kernels.linear(x, values, with_bias), rtol=1e-5, atol=1e-6 * float(scale))


@pytest.mark.parametrize("in_features", [128, 1088])
@pytest.mark.parametrize("kind", KINDS)
def test_a_row_gets_the_same_bits_alone_or_with_others(kind, in_features, monkeypatch):
    monkeypatch.setattr(kernels, "MAX_ROWS_BLOCKS", 80)  # 70 rows in the kernel too
    packed, _, _ = _packed(kind, 70, in_features)
    x = torch.randn(70, in_features)
    together = kernels.linear(x, packed)
    # On the AVX2 loop 1 and 2 rows dequantize and multiply row by row, 3 or more go through panels of
    # dequantized rows (1088 inputs: two panels, of 576 and 512), 64 input rows at a time (70: 64 + 6)
    for rows in (x[:2], x[:3], x[:4], x[:5], x[:7], x[:8], x[:16], x[:17], x):
        batch = kernels.linear(rows, packed)
        for row in range(rows.shape[0]):
            assert torch.equal(kernels.linear(rows[row:row + 1], packed), batch[row:row + 1])
            assert torch.equal(batch[row], together[row])


@pytest.mark.parametrize("avx512", [False, True])
def test_q4_1_pairs_give_the_bits_of_the_rows_they_came_from(avx512):
    """Repacking changes where the bytes lie, not a single product: on either loop, every row of every
    pass size gets the bits the Q4_1 rows give on that loop (and the float64 product's value)."""
    if avx512 and not kernels.avx512():
        pytest.skip(f"no AVX-512 loop on this CPU: {kernels.status()}")
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(70, 576, generator=generator) * torch.logspace(-2, 1, 576)
    weight[2, :64] = 0.0  # a pair of zero blocks: d = m = 0
    raw, values = _blocks(weight, "Q4_1")
    pairs, rows = kernels.pair_blocks(raw), raw.view(torch.int32)
    try:
        kernels.set_avx512(avx512)
        for count in (1, 2, 4, 5, 7, 8, 9, 17, 64):
            x = torch.randn(count, 576, generator=generator)
            got = kernels.linear(x, pairs)
            assert torch.equal(got, kernels.linear(x, rows))
            want = x.double() @ values.double().T
            scale = float((x.double().abs() @ values.double().abs().T).max())
            torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-6 * scale)
    finally:
        kernels.set_avx512(True)


@pytest.mark.parametrize("avx512", [False, True])
@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
def test_k_quant_rows_multiply_by_the_files_values(kind, avx512):
    """K-quant rows are repacked (Q4_K as Q4_1 pairs with fp32 scales, Q6_K as "Q6_K rows"): gguf-py's values
    exactly, on either loop, a row's bits the same alone or with others, and only where the rows hold the
    weight."""
    if avx512 and not kernels.avx512():
        pytest.skip(f"no AVX-512 loop on this CPU: {kernels.status()}")
    raw = _random_blocks(kind, 40, 512, torch.Generator().manual_seed(2))
    qtype = getattr(gguf.GGMLQuantizationType, kind)
    values = torch.from_numpy(np.asarray(dequantize(raw.numpy(), qtype), dtype=np.float32)).reshape(40, 512)
    packed = kernels._pack_weight(values, (kind, raw))
    assert packed.dtype == (kernels.PAIRS if kind == "Q4_K" else kernels.Q6_K_ROWS)
    edited = values.clone()
    edited[3, 100] += 1e-3
    assert kernels._pack_weight(edited, (kind, raw)).dtype == torch.float32  # not the rows' values
    assert kernels._pack_weight(values[:, :256], (kind, raw)).dtype == torch.float32  # another shape
    try:
        kernels.set_avx512(avx512)
        x = torch.randn(17, 512, generator=torch.Generator().manual_seed(4))
        together = kernels.linear(x, packed)
        want = x.double() @ values.double().T
        scale = float((x.double().abs() @ values.double().abs().T).max())
        torch.testing.assert_close(together.double(), want, rtol=0, atol=2e-6 * scale)
        for rows in (1, 2, 5, 7, 8, 9):
            assert torch.equal(kernels.linear(x[:rows], packed), together[:rows])
    finally:
        kernels.set_avx512(True)


def test_blocks_are_used_only_where_they_hold_the_weight():
    weight = torch.randn(32, 64)
    raw, values = _blocks(weight, "Q4_1")
    assert kernels._pack_weight(values, ("Q4_1", raw)).dtype == _dtype("Q4_1", 64, 32)
    assert kernels._pack_weight(values, ("Q4_K", raw)).dtype == torch.float32  # a format the kernel lacks
    assert kernels._pack_weight(weight, ("Q4_1", raw)).dtype == torch.float32  # not their values
    assert kernels._pack_weight(values[:16], ("Q4_1", raw)).dtype == torch.float32  # other rows
    narrow = torch.randn(32, 48)  # K % 32 != 0: no blocks
    assert kernels._pack_weight(narrow, ("Q4_1", raw[:, :30])).dtype == torch.float32
    layer = nn.Linear(64, 32, bias=False)
    with torch.no_grad():
        layer.weight.copy_(values)
    layer.gguf_blocks = ("Q4_1", raw)
    kernels.accelerate(layer)
    assert layer.packed.dtype == _dtype("Q4_1", 64, 32)
    x = torch.randn(3, 64)
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), F.linear(x, values), rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        layer.weight.mul_(2.0)  # edited in place: the blocks no longer hold it, so the weight is repacked
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight), rtol=1e-5, atol=1e-5)
    assert layer.packed.dtype == torch.float32


def _gguf_model(tied: bool = False) -> tuple[LlamaForCausalLM, LlamaForCausalLM]:
    """A tiny model whose linear layers carry GGUF rows (attention and head Q4_1, MLP Q8_0) and whose
    weights are those rows' dequantized values: (accelerated, plain torch copy)."""
    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=tied)
    torch.manual_seed(0)
    model, plain = LlamaForCausalLM(config).eval(), LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
        for name, module in model.named_modules():
            if isinstance(module, nn.Linear):
                kind = "Q8_0" if ".mlp." in name else "Q4_1"
                raw, values = _blocks(module.weight, kind)
                module.weight.copy_(values)
                module.gguf_blocks = (kind, raw)
        plain.load_state_dict(model.state_dict())
    assert kernels.accelerate(model) == 2 * 7 + 1
    return model, plain


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("fused", [True, False])
def test_a_model_on_block_weights_gives_torchs_logits(fused, tied, monkeypatch):
    model, plain = _gguf_model(tied)
    packed = {m.packed.dtype for m in model.modules() if isinstance(m, kernels.SmallRowsLinear)}
    assert packed == {_dtype("Q4_1", 64), _dtype("Q8_0", 64)}  # every layer's N is a multiple of 16
    assert "on (15 linear layers" in kernels.status(model)
    if kernels.amx_blocks():
        assert "9 on Q4_1 blocks (9 on AMX tiles), 6 on Q8_0 blocks (6 on AMX tiles)" in kernels.status(model)
    else:
        pairs = " (9 repacked in pairs)" if kernels.avx512() else ""
        assert f"9 on Q4_1 blocks{pairs}, 6 on Q8_0 blocks" in kernels.status(model)
    assert kernels.quantize(model) == 0  # block weights stay the file's own
    assert all(m.quantized is None for m in model.modules() if isinstance(m, kernels.SmallRowsLinear))
    monkeypatch.setattr(kernels, "FUSED_LAYERS", fused)
    calls = []
    for name in ("decoder_layer", "decoder_layers", "model_pass"):
        real = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda *a, real=real, **k: calls.append(1) or real(*a, **k))
    linears = []
    real_linear = kernels.linear
    monkeypatch.setattr(kernels, "linear", lambda x, w, b=None: linears.append(w.dtype) or real_linear(x, w, b))
    tokens = torch.randint(0, 96, (1, 24), generator=torch.Generator().manual_seed(2))
    caches = model.new_cache(1, 64), plain.new_cache(1, 64)
    passes = [(slice(0, 10), {}),                                     # prefill
              (slice(10, 11), {}),                                    # decode
              (slice(11, 12), dict(last_only=True, vocab_limit=40)),  # a draft step, limited ids
              (slice(12, 17), {})]                                    # verification
    for part, kwargs in passes:
        got = model(tokens[:, part], caches[0], **kwargs)
        with torch.inference_mode():
            want = plain(tokens[:, part], caches[1], **kwargs)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        for cache in caches:
            cache.commit(0, part.stop - part.start)
    assert bool(calls) == fused
    assert fused or {_dtype("Q4_1", 64), _dtype("Q8_0", 64)} <= set(linears)
    # the head's first 40 rows, as blocks (not a whole number of tiles: repacked from the file's rows)
    assert model._limited_head(40).packed.dtype == _dtype("Q4_1", 64, 40)
    # a batch of two rows goes through ``decoder_layers`` (fused) or the per-op layers
    batch = torch.randint(0, 96, (2, 6), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        torch.testing.assert_close(model(batch, model.new_cache(2, 16)), plain(batch, plain.new_cache(2, 16)),
                                   rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("verified", [6, 17, 40])
def test_a_token_gets_the_same_bits_alone_or_verified_on_block_weights(verified):
    """Up to rows_for's limit for GGUF blocks (64 on every loop) every projection, the head's too, stays in
    the kernel, whose sums do not depend on the rows."""
    model, _ = _gguf_model()
    assert verified <= kernels.rows_for(model.lm_head.packed)
    tokens = torch.randint(0, 96, (1, 8 + verified), generator=torch.Generator().manual_seed(4))
    together_cache, alone_cache = model.new_cache(1), model.new_cache(1)
    for cache in (together_cache, alone_cache):
        model(tokens[:, :8], cache)
        cache.commit(0, 8)
    together = model(tokens[:, 8:], together_cache)
    for step in range(8, 8 + verified):
        alone = model(tokens[:, step:step + 1], alone_cache)
        alone_cache.commit(0, 1)
        assert torch.equal(alone[0, 0], together[0, step - 8]), step
