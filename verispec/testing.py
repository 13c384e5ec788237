"""Small random checkpoints and a byte-level tokenizer, for tests and for the demo's fallback.

    target_dir, draft_dir = make_random_pair(Path("/tmp/pair"))

Models are written with transformers (``save_pretrained``) when ``via_transformers`` is set, so the
native loader is exercised on files it did not write itself.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

SPECIAL_TOKENS = ["<|endoftext|>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]


def make_byte_tokenizer(directory: Path) -> int:
    """A byte-level tokenizer (256 byte tokens + specials, no merges); returns its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    directory.mkdir(parents=True, exist_ok=True)
    alphabet = ByteLevel.alphabet()
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    for symbol in sorted(alphabet):
        vocab[symbol] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(SPECIAL_TOKENS)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
        "model_max_length": 4096,
        "chat_template": "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
                         "{% if add_generation_prompt %}<|assistant|>\n{% endif %}",
    }))
    return len(vocab)


def make_checkpoint(directory: Path, vocab_size: int, hidden: int = 64, layers: int = 2, heads: int = 4,
                    kv_heads: int = 2, arch: str = "llama", seed: int = 0, max_positions: int = 512,
                    tie: bool = False, via_transformers: bool = True, **extra) -> Path:
    """Random tiny checkpoint of ``arch`` (llama | qwen2 | mistral) in HF format."""
    torch.manual_seed(seed)
    common = dict(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                  num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                  max_position_embeddings=max_positions, tie_word_embeddings=tie, eos_token_id=0,
                  bos_token_id=None, **extra)
    if via_transformers:
        import transformers

        config_cls, model_cls = {
            "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
            "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
            "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        }[arch]
        model = model_cls(config_cls(**common))
        _spread_weights(model)
        model.save_pretrained(str(directory))
    else:
        from verispec.models.llama import LlamaConfig, LlamaForCausalLM, save_checkpoint

        model = LlamaForCausalLM(LlamaConfig(model_type=arch, **common))
        _spread_weights(model)
        save_checkpoint(model, directory, dtype=torch.float32)
    return directory


def _spread_weights(model: torch.nn.Module) -> None:
    # Default init (std 0.02) makes a tiny random model's next-token distribution almost uniform, so
    # greedy ties would be common and sampled tests would be dull. Wider weights give peaked,
    # prefix-dependent distributions.
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.dim() == 2:
                parameter.normal_(0.0, 0.25 if "embed" in name else 0.5 / parameter.shape[1] ** 0.5 * 2)


def make_random_pair(directory: Path, seed: int = 0) -> tuple[Path, Path]:
    """A random target (2 layers) and draft (1 layer) sharing a byte-level tokenizer."""
    target_dir, draft_dir = directory / "target", directory / "draft"
    if (target_dir / "config.json").is_file() and (draft_dir / "config.json").is_file():
        return target_dir, draft_dir
    for path in (target_dir, draft_dir):
        vocab = make_byte_tokenizer(path)
    make_checkpoint(target_dir, vocab, hidden=128, layers=4, seed=seed, via_transformers=False)
    make_checkpoint(draft_dir, vocab, hidden=64, layers=1, seed=seed + 1, via_transformers=False)
    return target_dir, draft_dir


def make_compressed_checkpoint(directory: Path, vocab_size: int, hidden: int = 32, layers: int = 2,
                               window: int = 5, block: int = 4, hca_block: int = 8, seed: int = 0,
                               max_positions: int = 256) -> Path:
    """Random tiny compressed-attention checkpoint (``models.compressed``), float32."""
    from verispec.models.compressed import CompressedConfig, CompressedForCausalLM, save_checkpoint

    torch.manual_seed(seed)
    config = CompressedConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                              num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                              window=window, block=block, hca_block=hca_block, max_position_embeddings=max_positions,
                              eos_token_id=0)
    model = CompressedForCausalLM(config)
    _spread_weights(model)
    save_checkpoint(model, directory, dtype=torch.float32)
    return directory
