"""models/llama_config.py: LlamaConfig read from HF's config.json (defaults, Qwen2's flags, the rope
parameters in their old and new places), written back, and the refusals that name the key."""

import pytest

from verispec.errors import CheckpointError
from verispec.models.llama_config import LlamaConfig

SIZES = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4)


def test_defaults_and_derived_sizes():
    config = LlamaConfig.from_hf_dict({"model_type": "llama", **SIZES})
    assert (config.kv_heads, config.dim_per_head, config.max_context) == (4, 8, 2048)
    assert config.rms_norm_eps == 1e-6 and config.rope_scaling is None and config.eos_ids == []
    grouped = LlamaConfig.from_hf_dict({"model_type": "mistral", **SIZES, "num_key_value_heads": 2, "head_dim": 16,
                                        "sliding_window": 512, "eos_token_id": [1, 2]})
    assert (grouped.kv_heads, grouped.dim_per_head, grouped.max_context, grouped.eos_ids) == (2, 16, 512, [1, 2])


def test_qwen2_biases_q_k_v_and_uses_its_window_only_when_asked():
    qwen2 = {"model_type": "qwen2", **SIZES, "attention_bias": True, "sliding_window": 16}
    config = LlamaConfig.from_hf_dict(qwen2)
    assert config.qkv_bias and not config.attention_bias and config.sliding_window is None
    assert LlamaConfig.from_hf_dict({**qwen2, "use_sliding_window": True}).max_context == 16
    llama = LlamaConfig.from_hf_dict({"model_type": "llama", **SIZES, "attention_bias": True})
    assert llama.attention_bias and not llama.qkv_bias


def test_rope_parameters_from_the_old_rope_scaling_and_the_new_rope_parameters():
    old = LlamaConfig.from_hf_dict({"model_type": "llama", **SIZES, "rope_theta": 500000.0,
                                    "rope_scaling": {"type": "linear", "factor": 2.0}})
    new = LlamaConfig.from_hf_dict({"model_type": "llama", **SIZES, "rope_parameters": {
        "rope_theta": 500000.0, "rope_type": "linear", "factor": 2.0}})
    assert new.rope_dict() == {"rope_theta": 500000.0, "rope_type": "linear", "factor": 2.0}
    assert {key: old.rope_dict()[key] for key in new.rope_dict()} == new.rope_dict()  # "type" read as rope_type


def test_to_hf_dict_round_trips():
    config = LlamaConfig.from_hf_dict({"model_type": "mistral", **SIZES, "num_key_value_heads": 2, "head_dim": 8,
                                       "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
                                       "rope_parameters": {"rope_theta": 1e4, "rope_type": "yarn", "factor": 4.0}})
    written = config.to_hf_dict()
    assert written["architectures"] == ["MistralForCausalLM"] and written["head_dim"] == 8
    assert LlamaConfig.from_hf_dict(written) == config


@pytest.mark.parametrize("change, message", [
    ({"model_type": "gpt2"}, "model_type 'gpt2' is not a Llama-family architecture the native model supports "
                             r"\(llama, qwen2, mistral\); load it through the transformers adapter instead"),
    ({"hidden_act": "gelu"}, r"hidden_act 'gelu' is not supported \(only silu\)"),
    ({"vocab_size": None}, "config.json: vocab_size must be a positive integer, got None"),
    ({"hidden_size": True}, "config.json: hidden_size must be a positive integer, got True"),
    ({"head_dim": 0}, "config.json: head_dim must be a positive integer, got 0"),
    ({"rms_norm_eps": 0.0}, "config.json: rms_norm_eps must be a positive number, got 0.0"),
    ({"rope_theta": float("inf")}, "config.json: rope_theta must be a positive number, got inf"),
    ({"num_key_value_heads": 3}, r"num_attention_heads \(4\) must be a multiple of num_key_value_heads \(3\)"),
    ({"hidden_size": 30}, r"hidden_size \(30\) must be a multiple of num_attention_heads \(4\), or give head_dim"),
    ({"eos_token_id": [2, -1]}, r"eos_token_id must be a token id >= 0 \(or a list of them\), got \[2, -1\]"),
])
def test_a_config_attention_cannot_be_built_from_is_refused(change, message):
    with pytest.raises(CheckpointError, match=message):
        LlamaConfig.from_hf_dict({"model_type": "llama", **SIZES, **change})


def test_a_missing_size_is_named():
    sizes = {key: value for key, value in SIZES.items() if key != "intermediate_size"}
    with pytest.raises(CheckpointError, match="config.json has no 'intermediate_size'; re-export the checkpoint"):
        LlamaConfig.from_hf_dict({"model_type": "llama", **sizes})
