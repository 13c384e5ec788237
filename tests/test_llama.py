"""The native model against transformers on the same checkpoints, and its cache/mask contract."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from verispec.errors import CheckpointError
from verispec.models.llama import load_checkpoint
from verispec.models.rope import rotary_tables
from verispec.testing import make_checkpoint

TOL = 2e-5


def hf_logits(path, ids):
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids).logits


def incremental_logits(model, ids, split):
    """Prefill ids[:, :split], then feed one token at a time, committing each."""
    cache = model.new_cache(ids.shape[0], 128)
    outs = [model.forward(ids[:, :split], cache)]
    cache.commit(0, split)
    for t in range(split, ids.shape[1]):
        outs.append(model.forward(ids[:, t:t + 1], cache))
        cache.commit(0, 1)
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize("name", ["llama", "qwen2", "llama_tied", "draft", "draft_qwen2"])
def test_logits_match_transformers(checkpoints, name):
    ids = torch.randint(0, 64, (1, 24), generator=torch.Generator().manual_seed(0))
    reference = hf_logits(checkpoints[name], ids)
    native = load_checkpoint(checkpoints[name])
    assert torch.allclose(incremental_logits(native, ids, 10), reference, atol=TOL)
    assert torch.allclose(native.train_forward(ids)[0], reference, atol=TOL)


@pytest.mark.parametrize("rope", [
    {"rope_type": "linear", "factor": 2.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
])
def test_rope_scaling_matches_transformers(tmp_path, rope):
    path = make_checkpoint(tmp_path / "m", 64, max_positions=512,
                           rope_parameters={"rope_theta": 10000.0, **rope})
    ids = torch.randint(0, 64, (1, 40), generator=torch.Generator().manual_seed(1))
    # These scalings change the frequencies themselves, so every position exercises them.
    native = load_checkpoint(path)
    reference = hf_logits(path, ids)
    assert torch.allclose(incremental_logits(native, ids, 20), reference, atol=TOL)


def test_mistral_and_half_precision_checkpoints(tmp_path):
    path = make_checkpoint(tmp_path / "mistral", 64, arch="mistral", seed=5)
    ids = torch.randint(0, 64, (1, 16), generator=torch.Generator().manual_seed(2))
    assert torch.allclose(load_checkpoint(path).train_forward(ids)[0], hf_logits(path, ids), atol=TOL)
    for dtype in (torch.float16, torch.bfloat16):
        half = tmp_path / str(dtype)
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
        model.save_pretrained(str(half))
        native = load_checkpoint(half)  # upcast to float32 on load
        assert native.lm_head.weight.dtype == torch.float32
        upcast = transformers.AutoModelForCausalLM.from_pretrained(str(half), dtype=torch.float32).eval()
        with torch.no_grad():
            assert torch.allclose(native.train_forward(ids)[0], upcast(ids).logits, atol=TOL)


def test_sharded_checkpoint(tmp_path, checkpoints):
    model = transformers.AutoModelForCausalLM.from_pretrained(str(checkpoints["llama"]))
    model.save_pretrained(str(tmp_path / "sharded"), max_shard_size="20KB")
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 1
    ids = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(3))
    assert torch.allclose(load_checkpoint(tmp_path / "sharded").train_forward(ids)[0],
                          hf_logits(checkpoints["llama"], ids), atol=TOL)


def test_tree_mask_equals_separate_chains(checkpoints):
    """Two branches verified in one pass see only their ancestors: logits equal per-branch chains."""
    model = load_checkpoint(checkpoints["llama"])
    prefix = torch.tensor([[5, 6, 7, 8]])
    # Tree over new nodes: 0 = root token, 1 and 2 children of 0, 3 child of 1.
    nodes = torch.tensor([[9, 10, 11, 12]])
    parents = [-1, 0, 0, 1]
    mask = torch.zeros(4, 4, dtype=torch.bool)
    depths = torch.zeros(4, dtype=torch.long)
    for j, parent in enumerate(parents):
        mask[j, j] = True
        ancestor = parent
        while ancestor >= 0:
            mask[j, ancestor] = True
            depths[j] += 1
            ancestor = parents[ancestor]
    cache = model.new_cache(1, 64)
    model.forward(prefix, cache); cache.commit(0, 4)
    tree_logits = model.forward(nodes, cache, tree_mask=mask, depths=depths)[0]
    for path in ([0, 1, 3], [0, 2]):
        chain = model.new_cache(1, 64)
        model.forward(prefix, chain); chain.commit(0, 4)
        chain_logits = model.forward(nodes[:, path], chain)[0]
        assert torch.allclose(tree_logits[path], chain_logits, atol=TOL)


def test_uncommitted_positions_are_invisible(checkpoints):
    """KV written by a rejected pass is never attended to: rollback is just not committing."""
    model = load_checkpoint(checkpoints["llama"])
    cache = model.new_cache(1, 64)
    model.forward(torch.tensor([[1, 2, 3]]), cache); cache.commit(0, 3)
    model.forward(torch.tensor([[40, 41, 42, 43]]), cache)  # rejected drafts, never committed
    after_rejection = model.forward(torch.tensor([[4]]), cache)
    fresh = model.new_cache(1, 64)
    model.forward(torch.tensor([[1, 2, 3]]), fresh); fresh.commit(0, 3)
    assert torch.allclose(after_rejection, model.forward(torch.tensor([[4]]), fresh), atol=TOL)


def test_batched_rows_with_different_lengths(checkpoints):
    model = load_checkpoint(checkpoints["qwen2"])
    rows = [[1, 2, 3, 4, 5], [6, 7]]
    cache = model.new_cache(2, 32)
    for row, tokens in enumerate(rows):  # prefill each row alone, then decode both together
        single = model.new_cache(1, 32)
        model.forward(torch.tensor([tokens]), single)
        cache.keys[:, row] = single.keys[:, 0]
        cache.values[:, row] = single.values[:, 0]
        cache.set_length(row, len(tokens))
    batched = model.forward(torch.tensor([[9, 10], [11, 12]]), cache)
    for row, tokens in enumerate(rows):
        alone = model.train_forward(torch.tensor([tokens + [[9, 10], [11, 12]][row]]))[0][0, -2:]
        assert torch.allclose(batched[row], alone, atol=TOL)


def test_bad_checkpoints_raise_clear_errors(tmp_path, checkpoints):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no config.json"):
        load_checkpoint(tmp_path / "empty")
    bad = tmp_path / "bad"; bad.mkdir()
    (bad / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_checkpoint(bad)
    gpt2 = tmp_path / "gpt2"; gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(CheckpointError, match="not a Llama-family"):
        load_checkpoint(gpt2)
    noweights = tmp_path / "noweights"; noweights.mkdir()
    (noweights / "config.json").write_text((checkpoints["llama"] / "config.json").read_text())
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        load_checkpoint(noweights)
    corrupt = tmp_path / "corrupt"; corrupt.mkdir()
    (corrupt / "config.json").write_text((checkpoints["llama"] / "config.json").read_text())
    (corrupt / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="cannot read"):
        load_checkpoint(corrupt)


def test_vocab_limit_scores_the_first_ids_and_masks_the_rest(checkpoints):
    model = load_checkpoint(checkpoints["llama"])
    tokens = torch.tensor([[1, 5, 9, 2]])
    full = model(tokens, model.new_cache(1))
    limited = model(tokens, model.new_cache(1), vocab_limit=10)
    torch.testing.assert_close(limited[..., :10], full[..., :10], rtol=1e-5, atol=1e-5)
    assert torch.isneginf(limited[..., 10:]).all()
    assert torch.equal(model(tokens, model.new_cache(1), vocab_limit=10_000), full)  # beyond V: all of it
    assert "_limited_heads" not in dict(model.named_modules()) and len(model.state_dict()) == len(
        load_checkpoint(checkpoints["llama"]).state_dict())  # the slice is no new parameter



def test_rotary_tables_grow_by_doubling_with_the_same_rows(checkpoints):
    model = load_checkpoint(checkpoints["llama"])
    limit = model.config.max_position_embeddings
    cos, sin = model._rotary_tables(5, torch.device("cpu"))
    assert cos.shape[0] == min(1024, limit) and model._rotary_tables(5, torch.device("cpu"))[0] is cos  # built once
    full_cos, full_sin = rotary_tables(model.rope_frequencies, model.attention_factor, limit, cos.dtype, "cpu")
    grown_cos, grown_sin = model._rotary_tables(limit, torch.device("cpu"))
    assert grown_cos.shape[0] == limit and torch.equal(grown_cos, full_cos) and torch.equal(grown_sin, full_sin)
    assert torch.equal(cos, full_cos[:cos.shape[0]]) and torch.equal(sin, full_sin[:sin.shape[0]])
