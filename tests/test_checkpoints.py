"""checkpoints.py without loading a model: checkpoint folders, devices, tokenizer files, shared-embedding
drafts, and whether a draft scores the target's token ids, each refusal with its message."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from verispec import loading
from verispec.checkpoints import (check_compatible, load_model, load_shared_draft, load_tokenizer, resolve_device,
                                  shares_embedding)
from verispec.errors import CheckpointError


def config_dir(root: Path, name: str, config) -> Path:
    folder = root / name
    folder.mkdir()
    (folder / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    return folder


@pytest.mark.parametrize("config, expected", [
    ({"verispec_shared_embedding": True}, True), ({"verispec_shared_embedding": False}, False), ({}, False),
    ("[true]", False), ("{broken", False),
])
def test_shares_embedding_reads_the_flag_and_tolerates_anything_else(tmp_path, config, expected):
    assert shares_embedding(config_dir(tmp_path, "d", config)) is expected


def test_shares_embedding_without_a_config(tmp_path):
    assert shares_embedding(tmp_path / "missing") is False


def test_a_shared_embedding_draft_needs_a_native_target(tmp_path):
    with pytest.raises(CheckpointError, match="shares the target's embedding, which needs a native "
                                              "Llama-family target"):
        load_shared_draft(tmp_path, SimpleNamespace())


def test_checkpoint_folders_are_checked_before_loading(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model(tmp_path / "nowhere")
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match=r"is a file, not a checkpoint directory"):
        load_model(tmp_path / "file")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=r"has no config.json; is it an HF checkpoint directory\?"):
        load_model(tmp_path / "empty")
    with pytest.raises(CheckpointError, match=r"is not valid JSON .*; re-export the checkpoint"):
        load_model(config_dir(tmp_path, "bad", "{"))
    with pytest.raises(CheckpointError, match=r"is not a JSON object; re-export the checkpoint"):
        load_model(config_dir(tmp_path, "list", "[]"))
    with pytest.raises(CheckpointError, match=r"unknown backend 'onnx'; choose one of auto, native, hf"):
        load_model(tmp_path / "empty", backend="onnx")


def test_a_tokenizer_needs_its_files_in_the_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match=r"has no tokenizer files \(tokenizer.json\); copy the tokenizer"):
        load_tokenizer(config_dir(tmp_path, "model", {}))


def test_devices():
    assert resolve_device("cpu") == "cpu" and resolve_device("cuda:1") == "cuda:1"
    with pytest.raises(CheckpointError, match=r"unknown device 'tpu'; use cpu or cuda"):
        resolve_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(CheckpointError, match="--device cuda was requested but no CUDA device is available"):
            resolve_device("cuda")


def test_a_draft_of_another_vocabulary_size_is_refused():
    target, draft = (SimpleNamespace(config=SimpleNamespace(vocab_size=n)) for n in (100, 64))
    check_compatible(target, SimpleNamespace(config=SimpleNamespace(vocab_size=100)))
    with pytest.raises(CheckpointError) as caught:
        check_compatible(target, draft)
    assert str(caught.value) == ("the draft's vocabulary (64 tokens) differs from the target's (100); speculative "
                                 "decoding needs a draft with the target's tokenizer")


def test_tokenizers_are_judged_by_ids_below_the_vocabulary():
    """A token a tokenizer class adds past the model's vocabulary at load time does not make two
    tokenizers different; a shifted id or another EOS does."""
    from verispec.loading import same_token_ids

    class Fake:
        def __init__(self, vocab, eos=0, bos=None):
            self.vocab, self.eos_token_id, self.bos_token_id = vocab, eos, bos

        def get_vocab(self):
            return dict(self.vocab)

    base = {"a": 0, "b": 1, "c": 2}
    assert same_token_ids(Fake(base), Fake({**base, "<|endoftext|>": 3}), vocab_size=3)
    assert same_token_ids(Fake(base), Fake({**base, "<|endoftext|>": 3}), vocab_size=8)  # an id only one has
    assert not same_token_ids(Fake(base), Fake({**base, "c2": 2}), vocab_size=8)  # id 2 names two tokens
    assert not same_token_ids(Fake(base), Fake({"a": 0, "b": 2, "c": 1}), vocab_size=3)
    assert not same_token_ids(Fake(base), Fake({"a": 0, "b": 1, "c": 2, "d": 3}, eos=2), vocab_size=4)


def test_same_token_ids_compares_every_id_when_no_size_is_given():
    class Fake:
        def __init__(self, vocab, eos=0, bos=None):
            self.vocab, self.eos_token_id, self.bos_token_id = vocab, eos, bos

        def get_vocab(self):
            return dict(self.vocab)

    base = {"a": 0, "b": 1}
    assert loading.same_token_ids(Fake(base), Fake(dict(base)))
    assert not loading.same_token_ids(Fake({**base, "x": 5}), Fake({**base, "y": 5}))  # id 5 differs, however high
    assert loading.same_token_ids(Fake({**base, "x": 5}), Fake({**base, "y": 5}), vocab_size=5)
    assert not loading.same_token_ids(Fake(base, bos=1), Fake(base, bos=None))  # BOS counts like EOS
