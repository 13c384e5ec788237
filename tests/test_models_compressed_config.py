"""models/compressed_config.py: CompressedConfig's derived sizes, its config.json round trip and the
refusals that name the value."""

import pytest

from verispec.errors import CheckpointError
from verispec.models.compressed_config import MODEL_TYPE, CompressedConfig


def test_derived_sizes_and_eos_ids():
    config = CompressedConfig(vocab_size=50, hidden_size=64, num_attention_heads=8, num_key_value_heads=2,
                              max_position_embeddings=300, eos_token_id=[3, 4])
    assert (config.kv_heads, config.dim_per_head, config.max_context, config.eos_ids) == (2, 8, 300, [3, 4])
    assert CompressedConfig(vocab_size=50, eos_token_id=7).eos_ids == [7]
    assert CompressedConfig(vocab_size=50).eos_ids == []


def test_config_json_round_trip_keeps_unknown_keys_out():
    config = CompressedConfig(vocab_size=50, window=9, block=3, hca_block=6, bos_token_id=1)
    written = config.to_dict()
    assert written["model_type"] == MODEL_TYPE == "verispec_compressed"
    assert written["architectures"] == ["VerispecCompressedForCausalLM"] and "extra" not in written
    assert CompressedConfig.from_dict({**written, "torch_dtype": "bfloat16"}) == config


@pytest.mark.parametrize("change, message", [
    ({"model_type": "llama"}, "model_type 'llama' is not 'verispec_compressed'"),
    ({"window": 0}, "config.json: window must be a positive integer, got 0"),
    ({"block": "4"}, "config.json: block must be a positive integer, got '4'"),
    ({"hca_block": -1}, "config.json: hca_block must be a non-negative integer, got -1"),
    ({"num_hidden_layers": True}, "config.json: num_hidden_layers must be a positive integer, got True"),
    ({"num_key_value_heads": 3}, "hidden_size must divide by num_attention_heads, and heads by key/value heads"),
])
def test_a_bad_config_json_is_refused_by_name(change, message):
    written = CompressedConfig(vocab_size=50).to_dict()
    with pytest.raises(CheckpointError, match=message):
        CompressedConfig.from_dict({**written, **change})


def test_a_missing_vocabulary_and_bad_blocks_in_code():
    with pytest.raises(CheckpointError, match="compressed-model config.json is incomplete: .*vocab_size"):
        CompressedConfig.from_dict({"model_type": MODEL_TYPE})
    with pytest.raises(CheckpointError, match=r"needs block >= 1, window >= 1, hca_block >= 0 \(got 0, 16, 0\)"):
        CompressedConfig(vocab_size=50, block=0)
