"""``CompressedConfig``: sizes and block lengths of the compressed-attention model (``models.compressed``),
read from and written to its config.json (model_type ``verispec_compressed``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from verispec.errors import CheckpointError

MODEL_TYPE = "verispec_compressed"


@dataclass(frozen=True)
class CompressedConfig:
    vocab_size: int
    hidden_size: int = 256
    intermediate_size: int = 768
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    window: int = 16  # raw positions a query sees, itself included
    block: int = 4  # CSA: tokens merged into one entry
    hca_block: int = 0  # HCA: tokens merged into one entry; 0 = no HCA level
    max_position_embeddings: int = 1024
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = True
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    model_type: str = MODEL_TYPE
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self):
        if self.block < 1 or self.window < 1 or self.hca_block < 0:
            raise CheckpointError(f"compressed model needs block >= 1, window >= 1, hca_block >= 0 "
                                  f"(got {self.block}, {self.window}, {self.hca_block})")
        if self.hidden_size % self.num_attention_heads or self.num_attention_heads % self.num_key_value_heads:
            raise CheckpointError("hidden_size must divide by num_attention_heads, and heads by key/value heads")

    # The names the engine and loaders read on any target.
    @property
    def kv_heads(self) -> int:
        return self.num_key_value_heads

    @property
    def dim_per_head(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def max_context(self) -> int:
        return self.max_position_embeddings

    @property
    def eos_ids(self) -> list[int]:
        if self.eos_token_id is None:
            return []
        return list(self.eos_token_id) if isinstance(self.eos_token_id, list) else [self.eos_token_id]

    def to_dict(self) -> dict:
        out = asdict(self)
        out.pop("extra")
        out["architectures"] = ["VerispecCompressedForCausalLM"]
        return out

    @classmethod
    def from_dict(cls, raw: dict) -> "CompressedConfig":
        if raw.get("model_type") != MODEL_TYPE:
            raise CheckpointError(f"model_type {raw.get('model_type')!r} is not {MODEL_TYPE!r}")
        names = set(cls.__dataclass_fields__) - {"extra"}
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "window", "block", "hca_block", "max_position_embeddings"):
            value, least = raw.get(key, 1), 0 if key == "hca_block" else 1
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                kind = "non-negative" if least == 0 else "positive"
                raise CheckpointError(f"config.json: {key} must be a {kind} integer, got {value!r}")
        try:
            return cls(**{k: v for k, v in raw.items() if k in names})
        except TypeError as err:
            raise CheckpointError(f"compressed-model config.json is incomplete: {err}") from None
