"""What a training run leaves behind: a checkpoint dir that loads back, its tokenizer files, JSON files."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from verispec.models.llama import LlamaConfig, LlamaForCausalLM, load_checkpoint
from verispec.train.artifacts import copy_tokenizer, export_checkpoint, write_json
from verispec.train.target import init_weights


def test_exported_checkpoint_loads_back_with_its_stop_ids_and_tokenizer(tmp_path):
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                                         bos_token_id=0, eos_token_id=0))
    init_weights(model, 0.2)
    tokenizer_dir = tmp_path / "tok"
    tokenizer_dir.mkdir()
    (tokenizer_dir / "tokenizer.json").write_text('{"fake": true}')
    (tokenizer_dir / "tokenizer_config.json").write_text("{}")  # no special_tokens_map.json: skipped
    export_checkpoint(model, tmp_path / "out", tokenizer_dir)
    out = tmp_path / "out"
    assert json.loads((out / "generation_config.json").read_text()) == {
        "bos_token_id": 0, "eos_token_id": [0, 4], "pad_token_id": 0}  # EOS and <|end|>
    assert (out / "tokenizer.json").read_text() == '{"fake": true}' and not (out / "special_tokens_map.json").exists()
    loaded = load_checkpoint(out, dtype=torch.float32, kernels=False).state_dict()
    for name, tensor in model.state_dict().items():  # stored in bf16
        assert torch.equal(loaded[name], tensor.bfloat16().float()), name


def test_copying_a_tokenizer_onto_itself_keeps_it(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{}")
    copy_tokenizer(tmp_path, tmp_path)
    assert (tmp_path / "tokenizer.json").read_text() == "{}"


def test_write_json_creates_the_parent_and_writes_paths_as_text(tmp_path):
    path = tmp_path / "runs" / "a" / "metrics.json"
    write_json(path, {"dir": Path("x/y"), "loss": 1.5})
    assert json.loads(path.read_text()) == {"dir": "x/y", "loss": 1.5} and path.read_text().endswith("}\n")
