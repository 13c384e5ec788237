"""The few-row linear kernel: equal to torch's linear, row results independent of the batch, the
model wrapper's fallbacks (grad, large inputs, edited weights), and its guards: input widths checked,
status() naming the paths. GGUF block weights: test_kernels_gguf.py; building, loading and the load-time
self-check: test_kernels_build.py."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from verispec import kernels
from verispec.models.llama import LlamaConfig, LlamaForCausalLM

pytestmark = pytest.mark.skipif(kernels.library() is None,
                                reason=f"kernel unavailable here: {kernels.status()}")


def _weights(out_features, in_features, bf16_exact, seed=0):
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=generator)
    return weight.to(torch.bfloat16).float() if bf16_exact else weight


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 13, 16])
@pytest.mark.parametrize("shape", [(8, 8), (13, 64), (640, 384), (130, 1024)])
@pytest.mark.parametrize("bf16", [False, True])
def test_kernel_matches_torch(rows, shape, bf16):
    out_features, in_features = shape
    weight = _weights(out_features, in_features, bf16)
    bias = torch.randn(out_features)
    x = torch.randn(1, rows, in_features)
    packed = weight.to(torch.bfloat16) if bf16 else weight
    for with_bias in (None, bias):
        got = kernels.linear(x, packed, with_bias)
        want = F.linear(x, weight, with_bias)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * in_features ** 0.5)


@pytest.mark.parametrize("out_features", [96, 93])  # 93: a last block of fewer than 8 (one row) or 4 weight rows
@pytest.mark.parametrize("bf16", [False, True])
def test_row_result_does_not_depend_on_other_rows(bf16, out_features):
    """Every output is summed in the same order whatever M is: bit-identical rows."""
    weight = _weights(out_features, 384, bf16)
    packed = weight.to(torch.bfloat16) if bf16 else weight
    x = torch.randn(16, 384)
    together = kernels.linear(x, packed)
    for row in range(16):
        assert torch.equal(kernels.linear(x[row:row + 1], packed), together[row:row + 1])
    assert torch.equal(kernels.linear(x[3:11], packed), together[3:11])


AMX_ONLY = pytest.mark.skipif(not kernels.amx(), reason=f"no AMX path here ({kernels._amx_reason})")


def _tiled(weight):
    packed = kernels._pack_weight(weight)
    assert packed.dtype == torch.int16, "expected AMX tiles"
    return packed


@pytest.mark.parametrize("rows", [1, 2, 7, 9, 16, 17, 33, 64])
@pytest.mark.parametrize("shape", [(16, 32), (640, 384), (128, 1024)])
@AMX_ONLY
def test_amx_tiles_match_torch_and_rows_are_independent(rows, shape):
    """The tile multiply of bf16 weights with x split exactly into three bf16 parts: fp32-accurate,
    and each row's result bit-identical whatever rows share the call (chunks of 16 included)."""
    out_features, in_features = shape
    weight = _weights(out_features, in_features, True, seed=rows)
    packed = _tiled(weight)
    bias = torch.randn(out_features)
    x = torch.randn(rows, in_features) * torch.logspace(-3, 3, in_features)  # magnitudes across the range
    for with_bias in (None, bias):
        got = kernels.linear(x, packed, with_bias)
        want = (x.double() @ weight.double().T + (0 if with_bias is None else with_bias.double())).float()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(x.abs().max()) * in_features ** 0.5)
    together = kernels.linear(x, packed)
    for row in {0, rows // 2, rows - 1}:
        assert torch.equal(kernels.linear(x[row:row + 1], packed), together[row:row + 1])


@AMX_ONLY
def test_tiled_layers_take_the_kernel_up_to_max_fused_rows(monkeypatch):
    """On AMX tiles a linear layer (the LM head, a verification of many rows) uses the kernel up to
    MAX_FUSED_AMX rows, where torch's fp32 GEMM would cost ~3x; beyond that, torch's path."""
    layer = nn.Linear(384, 640, bias=False)
    with torch.no_grad():
        layer.weight.copy_(_weights(640, 384, True))
    kernels.accelerate(layer)
    assert isinstance(layer, kernels.SmallRowsLinear) and layer.packed.dtype == torch.int16
    calls = []
    real = kernels.linear
    monkeypatch.setattr(kernels, "linear", lambda *args: calls.append(args[0].shape) or real(*args))
    reference = layer.weight.double()
    with torch.inference_mode():
        for rows, kernel in ((kernels.MAX_ROWS + 1, True), (kernels.MAX_FUSED_AMX, True),
                             (kernels.MAX_FUSED_AMX + 1, False)):
            calls.clear()
            x = torch.randn(rows, 384)
            torch.testing.assert_close(layer(x), (x.double() @ reference.T).float(), rtol=1e-5, atol=1e-4)
            assert bool(calls) == kernel, rows


def test_a_linear_layer_takes_the_kernel_up_to_max_rows_and_torch_beyond(monkeypatch):
    # 64 rows where the AVX-512 loop multiplies (it beat torch's GEMM up to there), else 16.
    assert kernels.max_rows() == (kernels.MAX_ROWS_AVX512 if kernels.avx512() else kernels.MAX_ROWS)
    layer = nn.Linear(384, 640, bias=False)
    with torch.no_grad():
        layer.weight.copy_(_weights(640, 384, True))
    kernels.accelerate(layer)
    if layer.packed.dtype in (torch.int16, torch.uint8):
        pytest.skip("AMX tiles take this layer up to MAX_FUSED_AMX rows: test_tiled_layers_take_the_kernel_up_to_max_fused_rows")
    calls = []
    real = kernels.linear
    monkeypatch.setattr(kernels, "linear", lambda *args: calls.append(args[0].shape) or real(*args))
    reference = layer.weight.double()
    with torch.inference_mode():
        for rows in (kernels.MAX_ROWS + 1, kernels.max_rows(), kernels.max_rows() + 1):
            calls.clear()
            x = torch.randn(rows, 384)
            torch.testing.assert_close(layer(x), (x.double() @ reference.T).float(), rtol=1e-5, atol=1e-4)
            assert bool(calls) == (rows <= kernels.max_rows()), rows


@AMX_ONLY
def test_amx_needs_whole_tiles_and_keeps_threads_out_of_results():
    assert kernels._pack_weight(_weights(24, 64, True)).dtype == torch.bfloat16  # N % 16: row-major
    assert kernels._pack_weight(_weights(32, 48, True)).dtype == torch.bfloat16  # K % 32: row-major
    assert kernels._pack_weight(_weights(32, 64, False)).dtype == torch.float32  # not bf16-exact
    packed, x = _tiled(_weights(640, 384, True)), torch.randn(9, 384)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernels.linear(x, packed)
        torch.set_num_threads(2)
        two = kernels.linear(x, packed)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_amx_is_switched_off_by_environment(monkeypatch):
    kernels.library.cache_clear()
    monkeypatch.setenv("VERISPEC_AMX", "0")
    try:
        assert kernels.library() is not None and not kernels.amx()
        assert kernels._pack_weight(_weights(32, 64, True)).dtype == torch.bfloat16
        assert "AMX off: disabled by VERISPEC_AMX=0" in kernels.status(_accelerated_tiny())
    finally:
        kernels.library.cache_clear()
        monkeypatch.delenv("VERISPEC_AMX")
        kernels.library()


def _accelerated_tiny():
    model = _tiny_llama(True)
    kernels.accelerate(model)
    return model


def test_threads_do_not_change_results():
    weight = _weights(257, 128, True)
    x = torch.randn(6, 128)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernels.linear(x, weight.to(torch.bfloat16))
        torch.set_num_threads(2)
        two = kernels.linear(x, weight.to(torch.bfloat16))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_accelerated_linear_keeps_parameters_and_falls_back():
    layer = nn.Linear(64, 32)
    reference = nn.Linear(64, 32)
    reference.load_state_dict(layer.state_dict())
    assert kernels.accelerate(layer) == 1
    assert isinstance(layer, kernels.SmallRowsLinear)
    assert list(layer.state_dict()) == ["weight", "bias"]
    assert layer.packed.dtype == torch.float32  # random fp32 weights are not bf16-exact
    x = torch.randn(2, 3, 64)
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), reference(x), rtol=1e-5, atol=1e-5)
    # Gradients: torch's path, so training through an accelerated model still works.
    out = layer(x)
    out.sum().backward()
    assert layer.weight.grad is not None
    # More rows than max_rows(): torch's path, same values.
    big = torch.randn(kernels.max_rows() + 1, 64)
    with torch.inference_mode():
        torch.testing.assert_close(layer(big), reference(big), rtol=1e-5, atol=1e-5)


def test_edited_weights_are_repacked():
    layer = nn.Linear(16, 8, bias=False)
    kernels.accelerate(layer)
    x = torch.randn(1, 16)
    with torch.no_grad():
        layer.weight.mul_(2.0)
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight), rtol=1e-5, atol=1e-5)


def _tiny_llama(bf16_weights):
    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    if bf16_weights:
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.copy_(parameter.to(torch.bfloat16).float())
    return model


@pytest.mark.parametrize("bf16_weights", [False, True])
def test_grouped_projections_and_model_logits(bf16_weights, kernel_path):
    plain = _tiny_llama(bf16_weights)
    fast = _tiny_llama(bf16_weights)
    assert kernels.accelerate(fast) == 2 * 7 + 1
    attention = fast.model.layers[0].self_attn
    assert attention.q_proj.group is not None and attention.q_proj.group is attention.v_proj.group
    assert fast.model.layers[0].mlp.gate_proj.group is not None
    assert "on (15 linear layers" in kernels.status(fast)
    dtypes = [m.packed.dtype for m in fast.modules() if isinstance(m, kernels.SmallRowsLinear)]
    tiled = bf16_weights and kernel_path == "amx"  # every shape here is a multiple of 16 x 32
    assert dtypes.count(torch.int16) == (15 if tiled else 0)
    assert dtypes.count(torch.bfloat16) == (15 if bf16_weights and not tiled else 0)
    tokens = torch.randint(0, 96, (1, 12))
    plain_cache, fast_cache = plain.new_cache(1), fast.new_cache(1)
    for model, cache in ((plain, plain_cache), (fast, fast_cache)):
        model(tokens[:, :4], cache)
        cache.commit(0, 4)
    for step in range(4, 12):  # decode one row at a time: the kernel's path
        want = plain(tokens[:, step:step + 1], plain_cache)
        got = fast(tokens[:, step:step + 1], fast_cache)
        plain_cache.commit(0, 1)
        fast_cache.commit(0, 1)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("rows", [1, 3, 16])
def test_native_rms_norm_matches_torch(rows):
    weight = torch.randn(384)
    x = torch.randn(1, rows, 384) * 3
    got = kernels.rms_norm(x, weight, 1e-5)
    torch.testing.assert_close(got, F.rms_norm(x, (384,), weight, 1e-5), rtol=1e-5, atol=1e-5)
    # Not applicable (the caller falls back to torch): too many rows, autograd, odd sizes, other dtypes.
    assert kernels.rms_norm(torch.randn(kernels.max_rows() + 1, 384), weight, 1e-5) is None
    assert kernels.rms_norm(x, weight.clone().requires_grad_(), 1e-5) is None
    assert kernels.rms_norm(torch.randn(2, 12), torch.randn(12), 1e-5) is None
    assert kernels.rms_norm(x.double(), weight.double(), 1e-5) is None


def test_a_checkpoint_loads_inside_inference_mode(checkpoints):
    """Loading under torch.inference_mode() used to fail packing (inference tensors have no version)."""
    from verispec.models.llama import load_checkpoint

    outside = load_checkpoint(checkpoints["llama"])
    with torch.inference_mode():
        inside = load_checkpoint(checkpoints["llama"])
        tokens = torch.tensor([[1, 2, 3, 4]])
        assert torch.equal(inside.forward(tokens, inside.new_cache(1, 16)), outside.forward(tokens, outside.new_cache(1, 16)))


@pytest.mark.parametrize("width", [56, 72])
def test_linear_refuses_an_input_of_another_width(width):
    """Like F.linear, instead of reading or writing past the kernel's buffers: every format, both widths named."""
    weight = torch.randn(16, 64)
    blocks = kernels._random_blocks("Q8_0", 16, 64, torch.Generator().manual_seed(0))
    for packed in (weight, weight.to(torch.bfloat16), kernels.quantize_int8(weight), blocks.view(torch.uint16)):
        with pytest.raises(ValueError, match=f"the input has {width} features but the weight .* takes 64"):
            kernels.linear(torch.randn(3, width), packed)
    with pytest.raises(ValueError, match="bias must be 16"):
        kernels.linear(torch.randn(3, 64), weight, torch.randn(15))
    with pytest.raises(ValueError, match="fp32 CPU inputs"):
        kernels.linear(torch.randn(3, 64, dtype=torch.float64), weight)
    with pytest.raises(ValueError, match="multiple of 8"):
        kernels.linear(torch.randn(3, 12), torch.randn(16, 12))


def test_status_names_the_instruction_set_paths():
    text = kernels.status()
    loop = "avx512" if kernels.avx512() else "avx2"  # which loop: test_kernels_isa.py
    assert text.startswith(f"available ({loop}: fp32, bf16, int8, Q4_1, Q8_0")
    assert ("; amx-bf16" in text) == kernels.amx()
    assert text.endswith(f"; AMX off: {kernels._amx_reason})") != kernels.amx()


@pytest.mark.parametrize("int8", [False, True], ids=["packed", "int8"])
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_first_rows_share_the_packed_weights_and_give_the_same_products(bf16, int8):
    """A vocabulary-limited LM head: the layer's first rows as views of its packed (and int8) rows,
    computing what the whole layer computes for those outputs, bit for bit."""
    layer = nn.Linear(64, 48, bias=False)
    with torch.no_grad():
        layer.weight.copy_(_weights(48, 64, bf16))
    kernels.accelerate(layer)
    if int8:
        kernels.quantize(layer)
    rows = kernels.first_rows(layer, 32)
    assert rows is not None and rows.out_features == 32 and rows.packed.data_ptr() == layer.packed.data_ptr()
    assert (rows.quantized is None) == (layer.quantized is None)
    x = torch.randn(3, 64)
    with torch.inference_mode():
        for count in (1, 3):
            assert torch.equal(rows(x[:count]), layer(x[:count])[:, :32])
    with torch.no_grad():
        layer.weight.mul_(2)  # stale packing: nothing to share
    assert kernels.first_rows(layer, 32) is None
    biased = nn.Linear(64, 48)
    kernels.accelerate(biased)
    assert kernels.first_rows(biased, 32) is None


def test_first_rows_respect_tiles_of_sixteen_rows():
    layer = nn.Linear(64, 48, bias=False)
    kernels.accelerate(layer)
    layer.packed = torch.zeros(48, 64, dtype=torch.int16)  # what AMX tiles look like: 16-row blocks
    assert kernels.first_rows(layer, 24) is None and kernels.first_rows(layer, 32) is not None
