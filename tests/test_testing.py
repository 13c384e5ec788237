"""testing.py: the byte-level tokenizer and the small random checkpoints the tests and the demo's
fallback are built from."""

from __future__ import annotations

import json

import torch

from verispec.testing import SPECIAL_TOKENS, make_byte_tokenizer, make_checkpoint, make_random_pair


def test_the_byte_tokenizer_has_the_specials_first_and_round_trips_any_text(tmp_path):
    from tokenizers import Tokenizer

    assert make_byte_tokenizer(tmp_path) == len(SPECIAL_TOKENS) + 256 == 261
    tokenizer = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert [tokenizer.token_to_id(t) for t in SPECIAL_TOKENS] == [0, 1, 2, 3, 4]
    text = "héllo, wörld ✓"
    ids = tokenizer.encode(text).ids
    assert len(ids) == len(text.encode("utf-8")) and all(5 <= i < 261 for i in ids)  # one token per byte
    assert tokenizer.decode(ids) == text
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["eos_token"] == "<|endoftext|>" and "chat_template" in config


def test_a_native_checkpoint_has_the_sizes_asked_for_and_is_seeded(tmp_path):
    from verispec.models.llama import load_checkpoint

    first = make_checkpoint(tmp_path / "a", 32, hidden=16, layers=1, heads=2, kv_heads=1, seed=3,
                            via_transformers=False)
    make_checkpoint(tmp_path / "b", 32, hidden=16, layers=1, heads=2, kv_heads=1, seed=3, via_transformers=False)
    config = json.loads((first / "config.json").read_text())
    sizes = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "eos_token_id")
    assert [config[key] for key in sizes] == [32, 16, 32, 1, 2, 1, 0]
    a, b = load_checkpoint(tmp_path / "a", kernels=False), load_checkpoint(tmp_path / "b", kernels=False)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    # Spread weights: the embedding's std is 0.25, not the default 0.02, for peaked distributions.
    assert 0.15 < float(a.model.embed_tokens.weight.detach().std()) < 0.35


def test_a_random_pair_already_written_is_reused(tmp_path):
    for name in ("target", "draft"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
    assert make_random_pair(tmp_path) == (tmp_path / "target", tmp_path / "draft")
    assert sorted(p.name for p in (tmp_path / "target").iterdir()) == ["config.json"]  # nothing rebuilt
