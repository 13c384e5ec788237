"""Reading one checkpoint: a model or a tokenizer from a ``.gguf`` file or an HF checkpoint directory, and
fitting a draft to its target (a shared embedding, int8 weights, the same token ids or a ``VocabBridge``).

    model = load_model("model.gguf")                  # native Llama family; other causal LMs via transformers
    tokenizer = load_tokenizer("checkpoints/draft")   # the directory's tokenizer.json

Names (``smollm2``, ``tiny``) and whole pairs are ``loading``'s concern.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Literal

import torch

from verispec import kernels
from verispec.errors import CheckpointError
from verispec.models.compressed import MODEL_TYPE as COMPRESSED_TYPE
from verispec.models.compressed import load_checkpoint as load_compressed
from verispec.models.gguf import gguf_tokenizer, load_gguf
from verispec.models.hf import load_hf_checkpoint
from verispec.models.checkpoint_io import read_config_json
from verispec.models.llama import ARCHITECTURES, LlamaForCausalLM, load_checkpoint
from verispec.models.protocol import Model, check_model
from verispec.vocab import VocabBridge

Backend = Literal["auto", "native", "hf"]
BACKENDS: tuple[str, ...] = ("auto", "native", "hf")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def resolve_device(device: str) -> str:
    if device == "cuda" and not torch.cuda.is_available():
        raise CheckpointError("--device cuda was requested but no CUDA device is available; use --device cpu")
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise CheckpointError(f"unknown device {device!r}; use cpu or cuda")
    return device


def load_model(path: str | Path, device: str = "cpu", backend: Backend = "auto") -> Model:
    """The native model for Llama/Qwen2/Mistral checkpoints, the transformers adapter for any other
    causal LM. backend: "native" or "hf" forces one ("hf" on a Llama checkpoint gives the peer baseline).
    The result is checked against the ``Model`` protocol."""
    model = _load_model(path, device, backend)
    check_model(model)
    return model


def _load_model(path: str | Path, device: str, backend: Backend) -> Model:
    if backend not in BACKENDS:
        raise CheckpointError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if is_gguf(path):
        if backend == "hf":  # transformers dequantizes the file itself: the peer baseline
            return load_hf_checkpoint(path, device=resolve_device(device))
        return load_gguf(path, device=resolve_device(device))
    path, device = checkpoint_dir(path), resolve_device(device)
    model_type = _model_type(path)
    if model_type == COMPRESSED_TYPE:  # our own architecture: only the native code can run it
        if backend == "hf":
            raise CheckpointError(f"{str(path)!r} is a verispec compressed-attention model; transformers "
                                  "cannot load it, use --backend auto or native")
        return load_compressed(path, device=device)
    if backend == "auto":
        backend = "native" if model_type in ARCHITECTURES else "hf"
    if backend == "native":
        return load_checkpoint(path, device=device)
    return load_hf_checkpoint(path, device=device)


def load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer

    if is_gguf(path):
        return gguf_tokenizer(path)
    path = checkpoint_dir(path)
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise CheckpointError(f"{str(path)!r} has no tokenizer files (tokenizer.json); copy the tokenizer "
                              "into the checkpoint directory")
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as err:  # transformers raises many types for a broken tokenizer
        raise CheckpointError(f"cannot load the tokenizer in {str(path)!r}: {err}") from None


def shares_embedding(draft_dir: str | Path) -> bool:
    """Whether a draft checkpoint takes its embedding and tied head from the target (see
    ``train.gguf_draft``): its config.json says ``"verispec_shared_embedding": true``."""
    config = Path(draft_dir) / "config.json"
    try:
        return bool(json.loads(config.read_text()).get("verispec_shared_embedding", False))
    except (OSError, json.JSONDecodeError, AttributeError):
        return False


def load_shared_draft(draft_dir: str | Path, target: Model) -> LlamaForCausalLM:
    """A draft whose checkpoint holds only its layers and final norm: the embedding and tied LM head are
    the target's own tensors (and, on the CPU kernel, its GGUF rows), so they cost no memory twice."""
    if not isinstance(target, LlamaForCausalLM):
        raise CheckpointError(f"the draft in {str(draft_dir)!r} shares the target's embedding, which needs a "
                              "native Llama-family target")
    draft = load_checkpoint(draft_dir, device=str(target.lm_head.weight.device), kernels=False,
                            shared_embedding=target.model.embed_tokens.weight)
    blocks = getattr(target.lm_head, "gguf_blocks", None)
    if blocks is not None:
        draft.lm_head.gguf_blocks = blocks
    kernels.accelerate(draft)
    return draft


def quantize_draft(draft: Model) -> int:
    """int8 weights for a native draft's kernel layers (``kernels.quantize``; per output row, and with
    AMX-INT8 per input row too): half the bytes of bf16 for every draft step, which at one row is bound
    by reading them. Lossless all the same: verification uses the probabilities of the draft that
    proposed, whatever its weights; only acceptance can move (the embedded draft's greedy matches on
    the held-out prompts moved by at most 0.1 point). Returns the layers quantized (0: not a native
    model on the CPU kernel, which keeps its weights)."""
    if not isinstance(draft, LlamaForCausalLM):
        return 0
    return kernels.quantize(draft)


def draft_to_q8_0(draft: Model) -> int:
    """A native draft's decoder layers rounded to GGUF Q8_0 blocks (``round_to_q8_0``) and packed again;
    its embedding and LM head (maybe the target's own) are kept. Lossless like ``quantize_draft``.
    Returns the layers rounded (0: not a native model)."""
    if not isinstance(draft, LlamaForCausalLM):
        return 0
    from torch import nn

    from verispec.models.gguf import round_to_q8_0

    layers = [m for m in draft.model.layers.modules() if isinstance(m, nn.Linear)]
    rounded = round_to_q8_0(layers)
    for layer in layers:
        if isinstance(layer, kernels.SmallRowsLinear):
            layer._pack()
    kernels.accelerate(draft)  # regroups the repacked layers and gathers them
    return rounded


def check_compatible(target: Model, draft: Model) -> None:
    """Target and draft must score the same token ids; refuse a draft with another vocabulary."""
    if target.config.vocab_size != draft.config.vocab_size:
        raise CheckpointError(
            f"the draft's vocabulary ({draft.config.vocab_size} tokens) differs from the target's "
            f"({target.config.vocab_size}); speculative decoding needs a draft with the target's tokenizer")


def bridge_for(tokenizer, target: Model, draft: Model, draft_dir: str | Path,
               allowed: bool = True) -> VocabBridge | None:
    """None for a draft that scores the target's ids; a ``VocabBridge`` for a draft that ships another
    tokenizer (announced on stderr, or refused when not ``allowed``); an error for a draft of another
    vocabulary size without a tokenizer of its own."""
    draft_dir = checkpoint_dir(draft_dir)
    if not any((draft_dir / name).is_file() for name in TOKENIZER_FILES):
        check_compatible(target, draft)
        return None
    draft_tokenizer = load_tokenizer(draft_dir)
    vocab = target.config.vocab_size
    if draft.config.vocab_size == vocab and same_token_ids(tokenizer, draft_tokenizer, vocab):
        return None
    if not allowed:
        raise CheckpointError(
            f"the draft's tokenizer in {str(draft_dir)!r} differs from the target's (its token -> id map or its "
            "EOS/BOS ids are not the same); here the draft must use the target's tokenizer (a draft with "
            "another tokenizer drafts in generate, audit and bench)")
    bridge = VocabBridge.build(tokenizer, draft_tokenizer, vocab, draft.config.vocab_size)
    print(f"verispec: the draft's tokenizer differs from the target's; it drafts over the {bridge.shared:,} "
          "tokens both share (token-level intersection)", file=sys.stderr)
    return bridge


def same_token_ids(first, second, vocab_size: int | None = None) -> bool:
    """Whether two tokenizers agree on every id below ``vocab_size`` (all ids when None) that both
    define, in both directions (no id names two tokens, no token has two ids), and on EOS and BOS. An
    id only one of them defines (a token a tokenizer class adds at load time) is no conflict: a draft
    never proposes an id it lacks, which keeps verification exact."""
    def by_id(tokenizer) -> dict[int, str]:
        return {index: token for token, index in tokenizer.get_vocab().items()
                if vocab_size is None or index < vocab_size}

    one, two = by_id(first), by_id(second)
    shared_ids = one.keys() & two.keys()
    if any(one[index] != two[index] for index in shared_ids):
        return False
    ids_one, ids_two = {t: i for i, t in one.items()}, {t: i for i, t in two.items()}
    if any(ids_one[token] != ids_two[token] for token in ids_one.keys() & ids_two.keys()):
        return False
    return all(getattr(first, name, None) == getattr(second, name, None) for name in ("eos_token_id", "bos_token_id"))


def _model_type(path: Path) -> str | None:
    return read_config_json(path).get("model_type")


def is_gguf(path: str | Path) -> bool:
    """Whether ``path`` names a GGUF file (by its suffix; the file is read later)."""
    return str(path).lower().endswith(".gguf")


def checkpoint_dir(path: str | Path) -> Path:
    """``path`` as an existing checkpoint directory, or a ``CheckpointError`` saying what it is instead."""
    path = Path(path).expanduser()
    if not path.exists():
        raise CheckpointError(f"checkpoint directory {str(path)!r} does not exist (models are loaded from local "
                              "directories; download a hub model first and pass its directory)")
    if not path.is_dir():
        raise CheckpointError(f"{str(path)!r} is a file, not a checkpoint directory")
    return path
