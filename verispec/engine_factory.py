"""From a loaded pair to an engine: ``ModelPair`` (what ``loading.load_pair`` returns) and ``build_engine``,
which picks the drafter and gamma policy a ``SpecConfig`` names and refuses up front a method the models'
declared ``Capabilities`` cannot run.

    engine = build_engine(pair, SpecConfig(method="chain", gamma=4))
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from verispec.adaptive import make_policy
from verispec.config import SpecConfig
from verispec.drafters.cross_vocab import CrossVocabDrafter
from verispec.drafters.draft_model import DraftModelDrafter
from verispec.drafters.eagle import EagleDrafter
from verispec.drafters.early_exit import EarlyExitDrafter
from verispec.drafters.lookup_first import behind_lookup
from verispec.drafters.ngram import NgramDrafter
from verispec.engine import SpecEngine
from verispec.errors import CheckpointError
from verispec.models.compressed import CompressedForCausalLM
from verispec.models.eagle import EagleHead
from verispec.models.hf import HFModel
from verispec.models.protocol import Model
from verispec.vocab import VocabBridge


@dataclass
class ModelPair:
    """A loaded target, its draft (None for drafter-free methods) and tokenizer, and where they came from."""

    target: Model
    draft: Model | None
    tokenizer: object  # a transformers PreTrainedTokenizerBase
    target_dir: Path
    draft_dir: Path | None
    eagle: EagleHead | None = None  # the feature head, when --method eagle
    eagle_dir: Path | None = None
    bridge: VocabBridge | None = None  # a draft with its own tokenizer drafts through it (token-level intersection)


def build_engine(pair: ModelPair, spec: SpecConfig) -> SpecEngine:
    """The engine ``spec`` asks for over ``pair``: its drafter, and for chains its gamma policy."""
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
    if drafter is not None:
        drafter = behind_lookup(drafter, spec.lookup, spec.lookup_drafts)
    tokenizer = pair.tokenizer
    policy = make_policy(spec.gamma_policy, spec.gamma) if spec.method == "chain" else None
    return SpecEngine(pair.target, drafter, decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                      gamma_policy=policy)


def row_drafter(pair: ModelPair, spec: SpecConfig):
    """What ``BatchEngine(make_drafter=...)`` lends each row for ``spec`` over ``pair`` where its own choice
    would be wrong, else None: a draft with another tokenizer drafts per row through the pair's vocabulary
    bridge (the batched draft-model pass drafts in the target's ids only)."""
    if not (spec.enabled and spec.drafter == "model") or pair.bridge is None or pair.draft is None:
        return None
    draft, bridge, vocab_limit = pair.draft, pair.bridge, spec.draft_vocab
    return lambda: behind_lookup(CrossVocabDrafter(draft, bridge, vocab_limit=vocab_limit), spec.lookup,
                                 spec.lookup_drafts)


def build_single(pair: ModelPair, spec: SpecConfig):
    """What decodes one request at a time (``verispec generate``): the batched engine as a batch of one
    (``verispec.batch.single``) lent ``build_engine``'s drafter, with ``SpecEngine.generate``'s interface."""
    from verispec.batch.single import BatchOfOne

    return BatchOfOne(build_engine(pair, spec), spec)


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
    if pair.bridge is not None and spec.method == "tree" and spec.tree_shape.dynamic:
        raise CheckpointError("a draft with another tokenizer drafts chains and static trees; use a static "
                              "shape such as --tree s3_k2_d6")
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
