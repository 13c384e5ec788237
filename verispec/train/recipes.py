"""Every default of the default-pair training recipes, defined once.

    >>> recipe = TargetRecipe()
    >>> recipe.model.hidden_size, recipe.model.num_hidden_layers, recipe.optim.tokens_per_step
    (384, 8, 8192)

`TargetRecipe` trains the target from scratch with LayerSkip (layer dropout + early-exit loss) so its
early layers can draft for self-speculation; `DraftRecipe` distils a much smaller model from a trained
target. Paths are relative to the repository root.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from verispec.models.compressed import CompressedConfig
from verispec.models.llama import LlamaConfig
from verispec.train.token_stream import DEFAULT_MIX

EOS_TOKEN_ID = 0  # <|endoftext|>, see chat_format.SPECIAL_TOKENS
VOCAB_SIZE = 8192
# The shipped tokenizer lives in the checkpoint dirs (one copy each, as HF expects); `verispec train
# tokenizer` writes a fresh one to runs/tokenizer/model, to pass to `verispec train target --tokenizer`.
TOKENIZER_DIR = "verispec/data/target"
NEW_TOKENIZER_DIR = "runs/tokenizer/model"
TARGET_DIR = "verispec/data/target"
DRAFT_DIR = "verispec/data/draft"
SMOLLM2_DRAFT_DIR = "verispec/data/smollm2-draft"  # the draft for SmolLM2 (``verispec train draft --target smollm2``)
COMPRESSED_DIR = "runs/compressed/model"  # not shipped: trained on demand (verispec train compressed)


def target_model_config() -> LlamaConfig:
    """~15.7M parameters: 8 layers, hidden 384, 6 query heads of dim 64 sharing 2 KV heads."""
    return LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=384, intermediate_size=1024, num_hidden_layers=8,
        num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-5,
        rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=EOS_TOKEN_ID, eos_token_id=EOS_TOKEN_ID)


def draft_model_config() -> LlamaConfig:
    """~3.9M parameters (2.1M of them the tied embedding): three layers, hidden 256, MLP 576, 4 heads, 1 KV head.

    On a CPU a small model's per-token cost is mostly per-layer overhead and the LM head, not weight
    reads, so a layer costs a fraction of the target's decode step (`verispec profile --threads 1`
    measures both) while more layers raise greedy acceptance. The shipped draft grew a third layer
    from a two-layer, MLP-768 draft (``--layers 3 --intermediate 576``: each MLP keeps its 576 busiest
    neurons, so three layers fit the 40 MB limit of both checkpoints); docs/model-card.md gives its
    acceptance."""
    return LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=256, intermediate_size=576, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=1024, rms_norm_eps=1e-5,
        rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=EOS_TOKEN_ID, eos_token_id=EOS_TOKEN_ID)


@dataclass(frozen=True)
class OptimConfig:
    """AdamW with linear warmup then cosine decay to ``min_lr_ratio * lr`` over the planned steps."""

    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    seq_len: int = 256
    micro_batch: int = 16  # sequences per forward pass
    accum_steps: int = 2  # micro-batches per optimizer step
    plan_after_steps: int = 5  # measure this many steps, then fix the planned step count
    log_every: int = 10
    checkpoint_every_s: float = 600.0
    seed: int = 0
    # "bf16": forward and backward under torch.autocast(bfloat16); weights, gradients and AdamW state stay
    # float32. On a CPU with AMX-BF16 this trains the target ~3x faster than "fp32" (docs/model-card.md
    # gives both runs' tokens/s); without bf16 matrix units autocast is slower, hence the CLI's "auto".
    precision: str = "fp32"

    @property
    def tokens_per_step(self) -> int:
        return self.seq_len * self.micro_batch * self.accum_steps


@dataclass(frozen=True)
class LayerSkipConfig:
    """Layer dropout rising linearly from 0 (first layer) to ``max_dropout`` (last layer); early-exit
    loss on ``exits_per_micro_batch`` exit layers, rotating through 1..L-1, each weighted
    ``exit_loss_scale * e / (L - 1)`` (deeper exits weigh more) on top of the final loss."""

    max_dropout: float = 0.1
    exits_per_micro_batch: int = 1
    exit_loss_scale: float = 0.5


@dataclass(frozen=True)
class EvalConfig:
    windows_per_workload: int = 48  # held-out windows of seq_len tokens per workload
    micro_batch: int = 16


@dataclass(frozen=True)
class TargetRecipe:
    model: LlamaConfig = field(default_factory=target_model_config)
    optim: OptimConfig = OptimConfig()
    layerskip: LayerSkipConfig = LayerSkipConfig()
    eval: EvalConfig = EvalConfig()
    mix: dict = field(default_factory=lambda: dict(DEFAULT_MIX))
    init_std: float = 0.02


@dataclass(frozen=True)
class DraftRecipe:
    """Distillation: ``(1 - ce_weight) * KL(target || draft) + ce_weight * CE(next token)``, temperature 1,
    plus ``argmax_weight * CE(the target's argmax)`` when set."""

    model: LlamaConfig = field(default_factory=draft_model_config)
    optim: OptimConfig = OptimConfig(lr=3e-3, warmup_steps=20, seed=1)
    eval: EvalConfig = EvalConfig()
    mix: dict = field(default_factory=lambda: dict(DEFAULT_MIX))
    ce_weight: float = 0.2
    argmax_weight: float = 0.0
    init_std: float = 0.02
    # Every 1/target_sample_fraction-th micro-batch is text the target itself sampled (temperature 1)
    # after a training-text prefix of sample_prefix tokens: the draft also learns on the target's own
    # generations, the distribution it will draft against.
    target_sample_fraction: float = 0.5
    sample_prefix: int = 32
    # Of those target-generated windows, this fraction is the target's greedy continuation: greedy
    # acceptance is measured on the target's greedy trajectories, which repeat themselves far more
    # than text does.
    greedy_sample_fraction: float = 0.5


def compressed_model_config() -> CompressedConfig:
    """~6.5M parameters: 4 layers, hidden 256; raw window 32, CSA blocks of 4, HCA blocks of 64."""
    return CompressedConfig(
        vocab_size=VOCAB_SIZE, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, window=32, block=4, hca_block=64,
        max_position_embeddings=1024, bos_token_id=EOS_TOKEN_ID, eos_token_id=EOS_TOKEN_ID)


@dataclass(frozen=True)
class CompressedRecipe:
    """Plain next-token cross-entropy on the default mix; the embedded draft (same tokenizer) drafts for it."""

    model: CompressedConfig = field(default_factory=compressed_model_config)
    optim: OptimConfig = OptimConfig(lr=3e-3, warmup_steps=20, seed=2)
    eval: EvalConfig = EvalConfig(windows_per_workload=24)
    mix: dict = field(default_factory=lambda: dict(DEFAULT_MIX))
    init_std: float = 0.02
