"""The transformers adapter: any causal LM as target or draft.

Oracle: HF's own full-sequence forward. Then the engine contracts: greedy spec == plain for every mix
of adapter and native models, trees where the architecture honours a custom 4-D mask (a clear error
where it cannot), the KV cache following the committed path, and the loader's dispatch, tokenizer
guard and error messages.
"""

from __future__ import annotations

import json

import pytest
import torch

from verispec import testing
from verispec.config import SamplingParams, SpecConfig, StopRules
from verispec.drafters import DraftModelDrafter
from verispec.engine import SpecEngine
from verispec.errors import CheckpointError, VerispecError
from verispec.loading import ModelPair, build_engine, load_model, load_pair
from verispec.models.hf import HFModel
from verispec.models.llama import LlamaForCausalLM

VOCAB = 64
GREEDY = SamplingParams(temperature=0.0)
PROMPT = [3, 14, 15, 9, 26, 5]


def save_hf(directory, config, seed):
    """A tiny random transformers model with wide weights (rare greedy ties), saved as a checkpoint."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    testing._spread_weights(model)
    model.save_pretrained(str(directory))
    return directory


def save_near_copy(source, directory, noise=0.1, seed=0):
    """The checkpoint at ``source`` with every weight matrix perturbed by ``noise`` times its spread: a
    draft that agrees with that target often but not always."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(source))
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 2:
                parameter.add_(noise * parameter.std() * torch.randn_like(parameter))
    model.save_pretrained(str(directory))
    return directory


def gpt2_config(vocab=VOCAB, hidden=64, layers=2, heads=4):
    from transformers import GPT2Config

    # Untied: with a tied head a random GPT-2 mostly repeats its last token.
    return GPT2Config(vocab_size=vocab, n_embd=hidden, n_layer=layers, n_head=heads, n_positions=256,
                      tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory, checkpoints):
    """GPT-2 and GPT-NeoX targets with near copies (noise 0.1: partial acceptance), a small GPT-2 draft,
    Bloom (ALiBi, no trees), and a near copy of conftest's Llama target."""
    from transformers import BloomConfig, GPTNeoXConfig

    root = tmp_path_factory.mktemp("hf")
    neox = GPTNeoXConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         intermediate_size=128, max_position_embeddings=256, bos_token_id=0, eos_token_id=0)
    dirs = {
        "gpt2": save_hf(root / "gpt2", gpt2_config(), seed=11),
        "gpt2_draft": save_hf(root / "gpt2_draft", gpt2_config(hidden=32, layers=1, heads=2), seed=12),
        "neox": save_hf(root / "neox", neox, seed=13),
        "bloom": save_hf(root / "bloom", BloomConfig(vocab_size=VOCAB, hidden_size=32, n_layer=1, n_head=2,
                                                     bos_token_id=0, eos_token_id=0), seed=14),
    }
    for name, source in [("gpt2", dirs["gpt2"]), ("neox", dirs["neox"]), ("llama", checkpoints["llama"])]:
        dirs[f"{name}_near"] = save_near_copy(source, root / f"{name}_near")
    return dirs


@pytest.fixture(scope="module")
def models(hf_dirs, checkpoints):
    """name -> model; names ending in _hf are Llama checkpoints forced through the adapter."""
    loaded = {name: load_model(path) for name, path in hf_dirs.items()}
    loaded["llama"] = load_model(checkpoints["llama"])
    loaded["llama_hf"] = load_model(checkpoints["llama"], backend="hf")
    loaded["llama_near_hf"] = load_model(hf_dirs["llama_near"], backend="hf")
    loaded["llama_draft"] = load_model(checkpoints["draft"])
    return loaded


_plain_outputs: dict[tuple[int, int], list[int]] = {}


def plain(target, max_tokens=40) -> list[int]:
    """Target-only greedy output (memoised: many tests compare against the same few)."""
    key = (id(target), max_tokens)
    if key not in _plain_outputs:
        _plain_outputs[key] = SpecEngine(target).generate(PROMPT, GREEDY, SpecConfig(method="none"),
                                                          StopRules(max_tokens=max_tokens)).tokens
    return _plain_outputs[key]


def fresh_prefill(model: HFModel, tokens):
    cache = model.new_cache(1, 256)
    model.forward(torch.tensor([tokens]), cache)
    return cache


def assert_hf_cache_matches_fresh_prefill(model: HFModel, cache, tokens):
    """Every layer's committed keys/values equal those of a fresh prefill of the committed tokens."""
    n = len(tokens)
    assert cache.lengths[0] == n and cache.written == n
    fresh = fresh_prefill(model, tokens)
    for (keys, values), (fresh_keys, fresh_values) in zip(cache.layer_tensors(), fresh.layer_tensors(), strict=True):
        assert torch.allclose(keys[0, :, :n], fresh_keys[0, :, :n], atol=1e-5)
        assert torch.allclose(values[0, :, :n], fresh_values[0, :, :n], atol=1e-5)


# ---- the adapter against HF's own forward ---------------------------------------------------------------

def test_dispatch_native_for_llama_adapter_otherwise(models):
    assert isinstance(models["llama"], LlamaForCausalLM) and isinstance(models["llama_near"], LlamaForCausalLM)
    assert isinstance(models["gpt2"], HFModel) and isinstance(models["neox"], HFModel)
    assert isinstance(models["llama_hf"], HFModel)
    assert models["gpt2"].config.vocab_size == VOCAB and models["gpt2"].config.max_context == 256
    assert models["gpt2"].config.eos_ids == [0] and models["neox"].config.num_hidden_layers == 2


@pytest.mark.parametrize("name", ["gpt2", "neox"])
def test_incremental_logits_equal_full_sequence(models, name):
    """Prefill, single steps, a pass whose tail is rejected (rolled back), then more: every committed
    position's logits equal HF's one-shot forward over the whole sequence."""
    model = models[name]
    tokens = torch.randint(0, VOCAB, (1, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model.model(tokens).logits[0]  # (24, V)
    cache = model.new_cache(1, 64)
    pieces = [model.forward(tokens[:, :10], cache)[0]]
    cache.commit(0, 10)
    pieces.append(model.forward(tokens[:, 10:11], cache, last_only=True)[0])
    cache.commit(0, 1)
    speculative = model.forward(torch.cat([tokens[:, 11:13], torch.tensor([[7, 8]])], 1), cache)[0]
    cache.commit(0, 2)  # keep tokens 11 and 12, drop the two wrong guesses
    pieces.append(speculative[:2])
    assert cache.written == 13
    pieces.append(model.forward(tokens[:, 13:], cache)[0])
    cache.commit(0, 11)
    assert torch.allclose(torch.cat(pieces), full, atol=1e-4)
    assert_hf_cache_matches_fresh_prefill(model, cache, tokens[0].tolist())


def test_tree_forward_equals_each_branch_as_a_chain(models):
    """One pass over root a with children b, c (c also has child d): each node's logits equal those of
    its root-to-node path run as a plain chain after the same prefix."""
    model = models["gpt2"]
    prefix, (a, b, c, d) = [5, 9, 2, 40], (11, 22, 33, 44)
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    cache = fresh_prefill(model, prefix)
    cache.commit(0, len(prefix))
    tree = model.forward(torch.tensor([[a, b, c, d]]), cache, tree_mask=mask, depths=torch.tensor([0, 1, 1, 2]))[0]
    for node, path in [(1, [a, b]), (2, [a, c]), (3, [a, c, d])]:
        chain = model.forward(torch.tensor([prefix + path]), model.new_cache(1, 64))[0, -1]
        assert torch.allclose(tree[node], chain, atol=1e-4)
    cache.compact(0, [4, 6, 7])  # accept a -> c -> d
    assert_hf_cache_matches_fresh_prefill(model, cache, prefix + [a, c, d])


def test_early_exit_and_unrollable_models_are_refused(models):
    from transformers import MambaConfig, MambaForCausalLM

    model = models["gpt2"]
    with pytest.raises(VerispecError, match="early exit"):
        model.forward(torch.tensor([[1, 2]]), model.new_cache(1, 16), num_layers=1)
    with pytest.raises(CheckpointError, match="cannot be rolled back"):
        HFModel(MambaForCausalLM(MambaConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1)))
    cache = model.new_cache(1, 16)
    model.forward(torch.tensor([[1, 2]]), cache)
    with pytest.raises(ValueError):
        cache.commit(0, 3)  # only 2 entries were written


# ---- greedy equality through the engine -------------------------------------------------------------

# Near pairs accept some drafts and reject others; _hf marks the adapter on a Llama checkpoint, so
# (llama, llama_near_hf) is a native target with an HF draft and (llama_hf, llama_near) the reverse.
NEAR_PAIRS = [("gpt2", "gpt2_near"), ("neox", "neox_near"), ("llama", "llama_near_hf"), ("llama_hf", "llama_near")]
CROSS_PAIRS = [("llama", "gpt2_draft"), ("gpt2", "llama_draft")]  # different architectures, one vocabulary


@pytest.mark.parametrize("gamma", [1, 3, 5])
@pytest.mark.parametrize("target_name,draft_name", NEAR_PAIRS)
def test_greedy_spec_equals_plain(models, target_name, draft_name, gamma):
    target = models[target_name]
    engine = SpecEngine(target, DraftModelDrafter(models[draft_name]))
    result = engine.generate(PROMPT, GREEDY, SpecConfig(gamma=gamma), StopRules(max_tokens=40))
    assert result.tokens == plain(target)
    assert 0 < result.stats.acceptance_rate < 1


@pytest.mark.parametrize("target_name,draft_name", CROSS_PAIRS)
def test_greedy_spec_equals_plain_across_architectures(models, target_name, draft_name):
    target = models[target_name]
    engine = SpecEngine(target, DraftModelDrafter(models[draft_name]))
    result = engine.generate(PROMPT, GREEDY, SpecConfig(gamma=3), StopRules(max_tokens=40))
    assert result.tokens == plain(target)


def test_draft_equal_to_target_accepts_everything(models):
    target = models["gpt2"]
    result = SpecEngine(target, DraftModelDrafter(target)).generate(PROMPT, GREEDY, SpecConfig(gamma=4),
                                                                    StopRules(max_tokens=40))
    assert result.tokens == plain(target) and result.stats.acceptance_rate == 1.0
    assert all(r.committed == 5 for r in result.stats.rounds[:-1])


def test_adapter_on_a_llama_checkpoint_matches_native(models):
    """backend="hf" on a Llama checkpoint is the peer baseline: same logits and greedy output as native."""
    native, peer = models["llama"], models["llama_hf"]
    tokens = torch.tensor([PROMPT])
    assert torch.allclose(peer.forward(tokens, peer.new_cache(1, 16)), native.forward(tokens, native.new_cache(1, 16)),
                          atol=1e-4)
    assert plain(peer) == plain(native)


@pytest.mark.parametrize("target_name,draft_name,shape", [
    ("gpt2", "gpt2_near", "s3_k2_d6"), ("neox", "neox_near", "s3_k2_d6"), ("llama_hf", "llama_near", "s3_k2_d6"),
    ("gpt2", "gpt2_near", "dynamic:8"), ("llama", "llama_near_hf", "dynamic:8"), ("gpt2", "gpt2", "s3_k2_d6")])
def test_greedy_tree_equals_plain(models, target_name, draft_name, shape):
    """Static trees exercise the HF target's tree mask and compaction; dynamic trees also the HF
    draft's level-by-level feeding with staged nodes."""
    target = models[target_name]
    spec = SpecConfig(method="tree", tree=shape)
    engine = build_engine(ModelPair(target, models[draft_name], None, None, None), spec)
    result = engine.generate(PROMPT, GREEDY, spec, StopRules(max_tokens=40))
    assert result.tokens == plain(target)
    assert any(r.accepted for r in result.stats.rounds)
    if target_name == draft_name:  # depth 3 fully accepted + bonus, every round but the last
        assert all(r.committed == 4 for r in result.stats.rounds[:-1])


def test_trees_refused_clearly_where_unsupported(models):
    bloom = models["bloom"]
    assert not bloom.supports_trees and models["gpt2"].supports_trees
    pair = ModelPair(bloom, models["gpt2_draft"], None, None, None)
    with pytest.raises(VerispecError, match="cannot verify trees.*--method chain"):
        build_engine(pair, SpecConfig(method="tree", tree="s3_k2_d6"))
    with pytest.raises(VerispecError, match="cannot verify trees"):
        bloom.forward(torch.tensor([[1, 2, 3]]), bloom.new_cache(1, 16), tree_mask=torch.ones(3, 3).bool().tril())
    engine = build_engine(pair, SpecConfig(gamma=3))  # chains still work
    assert engine.generate(PROMPT, GREEDY, SpecConfig(gamma=3), StopRules(max_tokens=20)).tokens == \
        plain(bloom, 20)
    with pytest.raises(CheckpointError, match="early exit"):
        build_engine(pair, SpecConfig(drafter="early_exit"))


@pytest.mark.parametrize("spec", [SpecConfig(gamma=3), SpecConfig(method="tree", tree="s3_k3_d8", sibling_mode="iid")])
def test_kv_cache_follows_committed_path(models, spec):
    """After sampled rounds (with rejections) both HF caches equal a fresh prefill of what they hold."""
    target, draft = models["gpt2"], models["gpt2_draft"]
    drafter = DraftModelDrafter(draft)
    generation = SpecEngine(target, drafter).stream(PROMPT, SamplingParams(temperature=1.0), spec,
                                                    StopRules(max_tokens=200), seed=5)
    for count, _ in enumerate(generation):
        if count == 12:
            break
    assert any(r.accepted < r.drafted for r in generation.stats.rounds), "want some rejections"
    assert any(r.accepted for r in generation.stats.rounds), "want some accepted drafts"
    assert_hf_cache_matches_fresh_prefill(target, generation.cache, generation.context[:-1])
    assert drafter.seen == generation.context[:len(drafter.seen)]
    assert_hf_cache_matches_fresh_prefill(draft, drafter.cache, drafter.seen)


# ---- loading -------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tokenized_dirs(tmp_path_factory):
    """target, same-tokenizer draft, a draft whose byte tokenizer has other special tokens (same size),
    and a draft without tokenizer files (it is taken to use the target's)."""
    root = tmp_path_factory.mktemp("tok")
    target, same, other, bare = root / "target", root / "same", root / "other", root / "bare"
    vocab = testing.make_byte_tokenizer(target)
    testing.make_byte_tokenizer(same)
    original = testing.SPECIAL_TOKENS
    try:
        testing.SPECIAL_TOKENS = ["<|eos|>", "<|human|>", "<|bot|>", "<|sys|>", "<|stop|>"]
        assert testing.make_byte_tokenizer(other) == vocab
    finally:
        testing.SPECIAL_TOKENS = original
    for seed, path in enumerate((target, same, other, bare)):
        save_hf(path, gpt2_config(vocab=vocab, hidden=16, layers=1, heads=2), seed=seed)
    return target, same, other, bare


def test_tokenizer_guard(tokenized_dirs):
    target, same, other, bare = tokenized_dirs
    pair = load_pair(target, same)
    assert isinstance(pair.target, HFModel) and isinstance(pair.draft, HFModel)
    assert load_pair(target, bare).draft is not None
    assert load_pair(target, same).bridge is None and load_pair(target, bare).bridge is None
    bridged = load_pair(target, other)  # other special tokens: it drafts over the tokens both share
    assert bridged.bridge is not None and bridged.bridge.shared < bridged.target.config.vocab_size
    with pytest.raises(CheckpointError, match="draft's tokenizer .* differs from the target's"):
        load_pair(target, other, cross_vocab=False)


def test_loading_errors(tmp_path, hf_dirs):
    unknown = tmp_path / "unknown"
    unknown.mkdir()
    (unknown / "config.json").write_text(json.dumps({"model_type": "no_such_architecture"}))
    with pytest.raises(CheckpointError, match="does not know model_type 'no_such_architecture'"):
        load_model(unknown)
    vision = tmp_path / "vision"
    vision.mkdir()
    (vision / "config.json").write_text(json.dumps({"model_type": "vit"}))
    with pytest.raises(CheckpointError, match="not a causal language model"):
        load_model(vision)
    (unknown / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_model(unknown)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model(tmp_path / "missing")
    with pytest.raises(CheckpointError, match="no config.json"):
        load_model(tmp_path)
    with pytest.raises(CheckpointError, match="unknown backend"):
        load_model(hf_dirs["gpt2"], backend="onnx")
    with pytest.raises(CheckpointError, match="not a Llama-family"):
        load_model(hf_dirs["gpt2"], backend="native")
    (unknown / "config.json").write_text(json.dumps({"model_type": "gpt2", "auto_map": {"AutoModel": "x.Y"}}))
    with pytest.raises(CheckpointError, match="custom modelling code"):
        load_model(unknown)
    (unknown / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(CheckpointError, match="no \\*.safetensors") as error:
        load_model(unknown)
    assert "\n" not in str(error.value)
