"""What a training run leaves behind: HF checkpoint dirs (with tokenizer), metrics.json, a loss plot.

    export_checkpoint(model, "verispec/data/target", tokenizer_dir="verispec/data/target")
    check_transformers_parity("verispec/data/target")   # max |logit difference| native vs transformers
    1.9e-06

A checkpoint dir holds config.json, model.safetensors (written by the native model's `save_checkpoint`),
generation_config.json and the tokenizer files, so `AutoModelForCausalLM` / `AutoTokenizer` and the
native loader all read it.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import torch

from verispec.models.llama import LlamaForCausalLM, load_checkpoint, save_checkpoint
from verispec.train.chat_format import END_TOKEN, SPECIAL_TOKENS

logger = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
CHECKPOINT_DTYPE = torch.bfloat16


def copy_tokenizer(tokenizer_dir: str | Path, out_dir: str | Path) -> None:
    """Copy the tokenizer files into a checkpoint dir (nothing to do when it is the same dir)."""
    for name in TOKENIZER_FILES:
        source, destination = Path(tokenizer_dir) / name, Path(out_dir) / name
        if source.exists() and not (destination.exists() and source.resolve() == destination.resolve()):
            shutil.copyfile(source, destination)


def export_checkpoint(model: LlamaForCausalLM, out_dir: str | Path, tokenizer_dir: str | Path) -> None:
    """Save weights + config, a generation config that stops on EOS or ``<|end|>``, and the tokenizer."""
    out_dir = Path(out_dir)
    save_checkpoint(model, out_dir, dtype=CHECKPOINT_DTYPE)
    stop_ids = [model.config.eos_token_id, SPECIAL_TOKENS.index(END_TOKEN)]
    generation = {"bos_token_id": model.config.bos_token_id, "eos_token_id": stop_ids,
                  "pad_token_id": model.config.eos_token_id}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    copy_tokenizer(tokenizer_dir, out_dir)
    logger.info("saved checkpoint to %s", out_dir)


def check_transformers_parity(checkpoint_dir: str | Path, seq_len: int = 64) -> float:
    """Max absolute logit difference between the native model and transformers on the same checkpoint."""
    from transformers import AutoModelForCausalLM

    native = load_checkpoint(checkpoint_dir, dtype=torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(str(checkpoint_dir), dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, native.config.vocab_size, (2, seq_len), generator=generator)
    with torch.no_grad():
        native_logits, _ = native.train_forward(tokens)
        reference_logits = reference(tokens).logits
    return (native_logits - reference_logits).abs().max().item()


def write_json(path: str | Path, payload: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(payload, indent=2, default=str) + "\n")


def plot_losses(records: list[dict], keys: list[str], path: str | Path, title: str) -> None:
    """Loss curves against tokens seen, one line per key present in the records."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4))
    for key in keys:
        points = [(r["tokens"], r[key]) for r in records if key in r]
        if points:
            axes.plot(*zip(*points), label=key, marker="." if len(points) < 40 else None)
    axes.set_xlabel("training tokens")
    axes.set_ylabel("loss (nats/token)")
    axes.set_title(title)
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
