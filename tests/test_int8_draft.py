"""int8 draft weights (``kernels.quantize``, ``loading.quantize_draft``): the kernel computes exactly the
quantized product it documents, a row's result does not depend on the other rows, a quantized model
runs the same through fused and per-op layers, and speculation with an int8 draft stays lossless
(greedy output equal to plain decoding; verification uses the quantized draft's own probabilities)."""

import pytest
import torch

from verispec import kernels
from verispec.config import SamplingParams, SpecConfig
from verispec.drafters.draft_model import DraftModelDrafter
from verispec.engine import SpecEngine
from verispec.errors import CheckpointError
from verispec.loading import build_engine, load_pair
from verispec.models.llama import LlamaConfig, LlamaForCausalLM
from verispec.stopping import StopRules

pytestmark = pytest.mark.skipif(kernels.library() is None,
                                reason=f"kernel unavailable here: {kernels.status()}")


def _spec_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The documented quantization, written out independently: per output row, scale = max |w| / 127
    and values round(w / scale) in [-127, 127]."""
    scale = weight.abs().amax(dim=1) / 127.0
    values = torch.round(weight / scale[:, None]).clamp(-127, 127)
    return values, scale


def _expected_tiles(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """What the AMX-INT8 path computes: x rows quantized like the weights (x * (1 / scale), rounded to
    nearest even), exact integer dot products, then float(acc) * (x scale * weight scale)."""
    values, scale = _spec_weight(weight)
    top = x.abs().amax(dim=1)
    x_scale = torch.where(top > 0, top / 127.0, torch.ones_like(top))
    x_values = torch.round(x * (1.0 / x_scale)[:, None])
    acc = (x_values.long() @ values.long().T).float()
    return acc * (x_scale[:, None] * scale[None, :])


@pytest.mark.parametrize("rows", [1, 2, 5, 16, 17, 40])
@pytest.mark.parametrize("shape", [(16, 64), (384, 256), (96, 768)])
def test_amx_int8_is_exactly_the_documented_product(rows, shape):
    if not kernels.amx_int8():
        pytest.skip(f"no AMX-INT8 here ({kernels._amx_reason or 'the CPU lacks amx_int8'})")
    out_features, in_features = shape
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(out_features, in_features, generator=generator) * 0.05
    x = torch.randn(rows, in_features, generator=generator) * torch.logspace(-2, 2, in_features)
    x[0, :] = 0.0  # an all-zero row: scale 1, output 0
    packed = kernels.quantize_int8(weight)
    assert packed.dtype == torch.uint8 and packed.shape == (out_features, in_features + 4)
    got = kernels.linear(x, packed)
    assert torch.equal(got, _expected_tiles(x, weight))
    bias = torch.randn(out_features, generator=generator)
    torch.testing.assert_close(kernels.linear(x, packed, bias), got + bias, rtol=0, atol=1e-5 * float(got.abs().max() + 1))
    for row in {0, rows // 2, rows - 1}:  # the same bits whatever rows share the call
        assert torch.equal(kernels.linear(x[row:row + 1], packed), got[row:row + 1])


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
def test_int8_rows_without_amx_match_the_dequantized_weights(rows, monkeypatch):
    """Without AMX-INT8 (or off whole tiles) the weights are int8 rows for the AVX2 loop: the product
    of fp32 inputs with the dequantized weights, rows independent, used for up to INT8_ROWS rows."""
    monkeypatch.setattr(kernels, "_amx_reason", "turned off by the test")
    weight = torch.randn(40, 72, generator=torch.Generator().manual_seed(3))  # neither N % 16 nor K % 64
    packed = kernels.quantize_int8(weight)
    assert packed.dtype == torch.int8 and kernels.rows_for(packed) == kernels.INT8_ROWS
    values, scale = _spec_weight(weight)
    x = torch.randn(rows, 72)
    got = kernels.linear(x, packed)
    want = (x.double() @ (values * scale[:, None]).double().T).float()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * 72 ** 0.5)
    assert torch.equal(kernels.linear(x[-1:], packed), got[-1:])


def _model(seed: int = 0) -> LlamaForCausalLM:
    """Shapes that fit AMX-INT8 tiles (N % 16 == 0, K % 64 == 0 for every projection and the head)."""
    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    kernels.accelerate(model)
    return model


def _decode_logits(model: LlamaForCausalLM, tokens: torch.Tensor) -> torch.Tensor:
    cache = model.new_cache(1)
    with torch.inference_mode():
        model(tokens[:, :6], cache)
        cache.commit(0, 6)
        out = []
        for step in range(6, tokens.shape[1]):
            out.append(model(tokens[:, step:step + 1], cache)[0, -1])
            cache.commit(0, 1)
    return torch.stack(out)


@pytest.mark.parametrize("path", ["amx", "avx2"])
def test_a_quantized_model_runs_fused_and_per_op_alike(path, monkeypatch):
    """``quantize`` gives every kernel layer int8 weights (grouped projections included); decoding through
    fused decoder layers and through the per-op path then gives the same logits, close to the float
    model's."""
    if path == "amx" and not kernels.amx_int8():
        pytest.skip("no AMX-INT8 here")
    if path == "avx2":
        monkeypatch.setattr(kernels, "_amx_reason", "turned off by the test")
    reference, model = _model(), _model()
    assert kernels.quantize(model) == 2 * 7 + 1
    layer = model.model.layers[0]
    assert layer.self_attn.q_proj.group.quantized is not None
    assert layer.self_attn.q_proj.quantized.data_ptr() == layer.self_attn.q_proj.group.quantized.data_ptr()
    assert "15 with int8 weights" in kernels.status(model)
    tokens = torch.randint(0, 96, (1, 14), generator=torch.Generator().manual_seed(1))
    fused = _decode_logits(model, tokens)
    assert kernels.LayerWeights.for_layer(layer).pointers_int8 is not None
    monkeypatch.setattr(kernels, "FUSED_LAYERS", False)
    per_op = _decode_logits(model, tokens)
    torch.testing.assert_close(fused, per_op, rtol=1e-4, atol=1e-4)
    floats = _decode_logits(reference, tokens)
    assert not torch.equal(fused, floats)  # it is quantized
    assert float((fused - floats).norm() / floats.norm()) < 0.05


def test_speculation_with_an_int8_draft_is_lossless():
    """Greedy chains with an int8 draft commit exactly plain decoding's tokens, and the draft's
    probabilities passed to verification are the quantized model's own."""
    target, draft = _model(seed=1), _model(seed=2)
    kernels.quantize(draft)
    prompt = torch.randint(0, 96, (10,), generator=torch.Generator().manual_seed(5)).tolist()
    stop = StopRules(max_tokens=30, ignore_eos=True)
    plain = SpecEngine(target).generate(prompt, SamplingParams(temperature=0), SpecConfig(method="none"), stop)
    for gamma in (1, 3, 6):
        spec = SpecEngine(target, DraftModelDrafter(draft)).generate(
            prompt, SamplingParams(temperature=0), SpecConfig(gamma=gamma), stop)
        assert spec.tokens == plain.tokens, gamma
    drafter = DraftModelDrafter(draft)
    sampling = SamplingParams(temperature=1.0)
    proposal = drafter.propose(prompt, 3, sampling, torch.Generator().manual_seed(0))
    cache = draft.new_cache(1)
    with torch.inference_mode():
        logits = draft(torch.tensor([prompt]), cache, last_only=True)[0, -1]
    torch.testing.assert_close(proposal.probs[0], torch.softmax(logits, -1))


def test_load_pair_quantizes_the_draft_only(byte_pair):
    target_dir, draft_dir = byte_pair
    pair = load_pair(target_dir, draft_dir)
    assert all(m.quantized is not None for m in pair.draft.modules() if isinstance(m, kernels.SmallRowsLinear))
    assert all(m.quantized is None for m in pair.target.modules() if isinstance(m, kernels.SmallRowsLinear))
    native = load_pair(target_dir, draft_dir, draft_weights="native")
    assert all(m.quantized is None for m in native.draft.modules() if isinstance(m, kernels.SmallRowsLinear))
    with pytest.raises(CheckpointError, match="unknown draft weights"):
        load_pair(target_dir, draft_dir, draft_weights="int4")
    prompt, stop = list(range(3, 15)), StopRules(max_tokens=24, ignore_eos=True)
    greedy = SamplingParams(temperature=0)
    want = build_engine(pair, SpecConfig(method="none")).generate(prompt, greedy, SpecConfig(method="none"), stop)
    got = build_engine(pair, SpecConfig(gamma=4)).generate(prompt, greedy, SpecConfig(gamma=4), stop)
    assert got.tokens == want.tokens
