"""``LlamaConfig``: the native Llama-family model's sizes and options, read from and written to HF's
config.json, with the checks that refuse a config.json attention cannot be built from."""

from __future__ import annotations

from dataclasses import dataclass, field

from verispec.errors import CheckpointError

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # HF's rope parameters beyond theta: rope_type, factor, ...
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q, k, v and o (Llama's flag)
    qkv_bias: bool = False  # bias on q, k, v only (Qwen2)
    mlp_bias: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    model_type: str = "llama"
    extra: dict = field(default_factory=dict, compare=False)

    @property
    def kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def max_context(self) -> int:
        return min(self.max_position_embeddings, self.sliding_window or self.max_position_embeddings)

    @property
    def eos_ids(self) -> list[int]:
        if self.eos_token_id is None:
            return []
        return list(self.eos_token_id) if isinstance(self.eos_token_id, list) else [self.eos_token_id]

    @classmethod
    def from_hf_dict(cls, hf: dict) -> "LlamaConfig":
        model_type = hf.get("model_type")
        if model_type not in ARCHITECTURES:
            raise CheckpointError(
                f"model_type {model_type!r} is not a Llama-family architecture the native model supports "
                f"({', '.join(ARCHITECTURES)}); load it through the transformers adapter instead")
        if hf.get("hidden_act", "silu") != "silu":
            raise CheckpointError(f"hidden_act {hf['hidden_act']!r} is not supported (only silu)")
        check_config_values(hf)
        rope = dict(hf.get("rope_parameters") or {})
        rope.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
        for key, value in (hf.get("rope_scaling") or {}).items():
            rope.setdefault(key, value)
        if rope.get("type") and "rope_type" not in rope:
            rope["rope_type"] = rope["type"]
        sliding = hf.get("sliding_window")
        if model_type == "qwen2" and not hf.get("use_sliding_window", False):
            sliding = None
        return cls(
            vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"], num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=hf["num_attention_heads"],
            num_key_value_heads=hf.get("num_key_value_heads"), head_dim=hf.get("head_dim"),
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6), rope_theta=float(rope["rope_theta"]),
            rope_scaling={k: v for k, v in rope.items() if k != "rope_theta"} or None,
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            attention_bias=hf.get("attention_bias", False) if model_type != "qwen2" else False,
            qkv_bias=model_type == "qwen2", mlp_bias=hf.get("mlp_bias", False), sliding_window=sliding,
            bos_token_id=hf.get("bos_token_id"), eos_token_id=hf.get("eos_token_id"),
            model_type=model_type)

    def to_hf_dict(self) -> dict:
        rope = {"rope_theta": self.rope_theta, "rope_type": "default", **(self.rope_scaling or {})}
        out = {
            "architectures": [ARCHITECTURES[self.model_type]], "model_type": self.model_type,
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.kv_heads,
            "head_dim": self.dim_per_head, "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta, "rope_parameters": rope,
            "tie_word_embeddings": self.tie_word_embeddings, "attention_bias": self.attention_bias,
            "mlp_bias": self.mlp_bias, "hidden_act": "silu", "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
        }
        return out

    def rope_dict(self) -> dict:
        return {"rope_theta": self.rope_theta, **(self.rope_scaling or {})}


REQUIRED_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
OPTIONAL_SIZES = ("num_key_value_heads", "head_dim", "max_position_embeddings", "sliding_window")


def check_config_values(hf: dict) -> None:
    """Refuse, with a CheckpointError naming the key, a config.json whose sizes are missing, not positive
    integers, or do not divide as attention needs (before torch sees them and raises its own errors)."""
    def positive_int(value) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value > 0

    def positive_number(value) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < float("inf")

    for key in REQUIRED_SIZES:
        if key not in hf:
            raise CheckpointError(f"config.json has no {key!r}; re-export the checkpoint")
    for key in REQUIRED_SIZES + OPTIONAL_SIZES:
        value = hf.get(key)
        if (key in REQUIRED_SIZES or value is not None) and not positive_int(value):
            raise CheckpointError(f"config.json: {key} must be a positive integer, got {value!r}")
    for key in ("rms_norm_eps", "rope_theta"):
        if hf.get(key) is not None and not positive_number(hf[key]):
            raise CheckpointError(f"config.json: {key} must be a positive number, got {hf[key]!r}")
    heads, kv_heads = hf["num_attention_heads"], hf.get("num_key_value_heads") or hf["num_attention_heads"]
    if heads % kv_heads:
        raise CheckpointError(f"config.json: num_attention_heads ({heads}) must be a multiple of "
                              f"num_key_value_heads ({kv_heads})")
    if hf.get("head_dim") is None and hf["hidden_size"] % heads:
        raise CheckpointError(f"config.json: hidden_size ({hf['hidden_size']}) must be a multiple of "
                              f"num_attention_heads ({heads}), or give head_dim")
    for key in ("bos_token_id", "eos_token_id"):
        value = hf.get(key)
        ids = value if isinstance(value, list) else [value]
        if value is not None and not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            raise CheckpointError(f"config.json: {key} must be a token id >= 0 (or a list of them), got {value!r}")
