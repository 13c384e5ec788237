"""The only factory: builds target, draft, drafter, tokenizer and engine from checkpoint dirs / options.

    pair = load_pair(target_dir=None, draft_dir=None)   # None -> the embedded default pair
    engine = build_engine(pair, SpecConfig(method="chain", gamma=4))
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from verispec.config import SpecConfig
from verispec.drafters.draft_model import DraftModelDrafter
from verispec.drafters.early_exit import EarlyExitDrafter
from verispec.drafters.ngram import NgramDrafter
from verispec.engine import SpecEngine
from verispec.errors import CheckpointError
from verispec.models.llama import LlamaForCausalLM, load_checkpoint

log = logging.getLogger(__name__)

DATA_DIR = Path(__file__).parent / "data"
DEFAULT_TARGET = DATA_DIR / "target"
DEFAULT_DRAFT = DATA_DIR / "draft"


@dataclass
class ModelPair:
    target: LlamaForCausalLM
    draft: LlamaForCausalLM | None
    tokenizer: object  # a transformers PreTrainedTokenizerBase
    target_dir: Path
    draft_dir: Path | None


def embedded_pair_available() -> bool:
    return (DEFAULT_TARGET / "config.json").is_file() and (DEFAULT_DRAFT / "config.json").is_file()


def resolve_device(device: str) -> str:
    if device == "cuda" and not torch.cuda.is_available():
        raise CheckpointError("--device cuda was requested but no CUDA device is available; use --device cpu")
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise CheckpointError(f"unknown device {device!r}; use cpu or cuda")
    return device


def load_model(path: str | Path, device: str = "cpu") -> LlamaForCausalLM:
    return load_checkpoint(_checkpoint_dir(path), device=resolve_device(device))


def load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer

    path = _checkpoint_dir(path)
    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
        raise CheckpointError(f"{str(path)!r} has no tokenizer files (tokenizer.json); copy the tokenizer "
                              "into the checkpoint directory")
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as err:  # transformers raises many types for a broken tokenizer
        raise CheckpointError(f"cannot load the tokenizer in {str(path)!r}: {err}") from None


def load_pair(target_dir: str | Path | None = None, draft_dir: str | Path | None = None,
              device: str = "cpu", need_draft: bool = True) -> ModelPair:
    """Load target (+ draft); None for both means the embedded default pair shipped in the package."""
    if target_dir is None:
        if not embedded_pair_available():
            raise CheckpointError("the embedded default model pair is not installed in this package; pass "
                                  "--target DIR (and --draft DIR)")
        target_dir = DEFAULT_TARGET
        draft_dir = DEFAULT_DRAFT if draft_dir is None else draft_dir
    target = load_model(target_dir, device)
    draft = load_model(draft_dir, device) if (need_draft and draft_dir is not None) else None
    if draft is not None:
        check_compatible(target, draft)
    return ModelPair(target, draft, load_tokenizer(target_dir), Path(target_dir),
                     Path(draft_dir) if draft_dir is not None else None)


def check_compatible(target: LlamaForCausalLM, draft: LlamaForCausalLM) -> None:
    """Target and draft must score the same token ids; refuse a draft with another vocabulary."""
    if target.config.vocab_size != draft.config.vocab_size:
        raise CheckpointError(
            f"the draft's vocabulary ({draft.config.vocab_size} tokens) differs from the target's "
            f"({target.config.vocab_size}); speculative decoding needs a draft with the target's tokenizer")


def build_engine(pair: ModelPair, spec: SpecConfig) -> SpecEngine:
    drafter = None
    if spec.enabled and spec.drafter == "ngram":
        drafter = NgramDrafter(spec.ngram_max, spec.ngram_min)
    elif spec.enabled and spec.drafter == "early_exit":
        drafter = EarlyExitDrafter(pair.target, spec.exit_layer)
    elif spec.enabled:
        if pair.draft is None:
            raise CheckpointError(f"--method {spec.method} needs a draft model; pass --draft DIR or use --no-spec")
        drafter = DraftModelDrafter(pair.draft)
    tokenizer = pair.tokenizer
    return SpecEngine(pair.target, drafter, decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True))


def _checkpoint_dir(path: str | Path) -> Path:
    path = Path(path).expanduser()
    if not path.exists():
        raise CheckpointError(f"checkpoint directory {str(path)!r} does not exist (models are loaded from local "
                              "directories; download a hub model first and pass its directory)")
    if not path.is_dir():
        raise CheckpointError(f"{str(path)!r} is a file, not a checkpoint directory")
    return path
