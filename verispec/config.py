"""Frozen configuration objects; every default is defined here, once.

``SamplingParams`` is applied identically to target and draft of one request (see sampling.py).
``SpecConfig`` says how to speculate: method, gamma (drafts per round) and, for trees, the shape.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from verispec.errors import SamplingError

Method = Literal["none", "chain", "tree"]
METHODS: tuple[str, ...] = ("none", "chain", "tree")
SiblingMode = Literal["iid", "without_replacement", "deterministic"]
SIBLING_MODES: tuple[str, ...] = ("iid", "without_replacement", "deterministic")
DYNAMIC_TREE_DEPTH, DYNAMIC_TREE_TOPK = 6, 4
GammaPolicy = Literal["fixed", "adaptive", "hf"]
GAMMA_POLICIES: tuple[str, ...] = ("fixed", "adaptive", "hf")
# What ``generate`` and ``serve`` run a chain with unless told otherwise. Where speculation does not pay
# (SmolLM2 on the Zen 4 EPYC) adaptive ran at 0.97-1.00x of plain decoding once it had measured a few
# requests, served c1-c16 at 0.98-1.00x, and a lone cold 64-token request at 0.94x, where fixed gamma 4 ran
# at 0.49x; where it pays (the tiny pair) it beat the best fixed gamma, 1.54x against 1.51x. ``SpecConfig`` itself stays "fixed": a library caller gets what
# it asks for. Trees always run their fixed shape; ``audit`` and ``bench`` name their policies.
COMMAND_CHAIN_POLICY: str = "adaptive"
DrafterKind = Literal["model", "ngram", "early_exit", "eagle"]
DRAFTER_KINDS: tuple[str, ...] = ("model", "ngram", "early_exit", "eagle")
# How a drafter holds its own weights (--draft-weights): auto is int8 for a draft model, GGUF Q8_0 blocks
# for an EAGLE head (int8 rows quantize the head's inputs too on AMX and it guessed worse; Q8_0 keeps them).
DRAFT_WEIGHTS: tuple[str, ...] = ("auto", "int8", "q8_0", "native")


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy; top_k 0, top_p 1 and min_p 0 switch their filter off.

    Penalties (0, 0 and 1 are off) act on the logits before temperature, for target and drafts alike,
    counting the output so far including a round's earlier drafts (``verispec.guide``): presence and
    frequency in [-2, 2] as OpenAI's, repetition > 0 as vLLM's (prompt and output tokens).

    ``guide``: a request's grammar constraint (``verispec.grammar.Constraint``; the engines wrap it, with
    the penalties, in a ``verispec.guide.Guide``), whose mask comes after the penalties and before every
    other transform; None for unconstrained output. It is per-request state, so it takes no part in
    comparing or hashing parameters."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    guide: object | None = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        if not 0 <= self.temperature < float("inf"):  # inf would make every distribution uniform
            raise SamplingError(f"temperature must be >= 0 and finite (0 = greedy), got {self.temperature}")
        if not (isinstance(self.top_k, int) and self.top_k >= 0):
            raise SamplingError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise SamplingError(f"top_p must be in (0, 1] (1 = off), got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise SamplingError(f"min_p must be in [0, 1] (0 = off), got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise SamplingError(f"{name} must be in [-2, 2] (0 = off), got {getattr(self, name)}")
        if not 0 < self.repetition_penalty < float("inf"):
            raise SamplingError(f"repetition_penalty must be > 0 and finite (1 = off), got {self.repetition_penalty}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)


@dataclass(frozen=True)
class StopRules:
    """When a request ends: max_tokens new tokens, an EOS id (unless ignore_eos) or a stop string."""

    max_tokens: int = 64
    eos_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    stop_strings: tuple[str, ...] = ()

    def __post_init__(self):
        if self.max_tokens < 1:
            raise SamplingError(f"max_tokens must be >= 1, got {self.max_tokens}")


@dataclass(frozen=True)
class TreeShape:
    """``sN_kK_dD``: N draft steps (depth), top-K branching, D verified nodes (root included), a fixed
    topology: the first-drawn child is expanded at every level (the main path, N nodes) and the
    remaining D - 1 - N nodes are extra siblings of main-path nodes, shallowest levels first.
    ``s4_k1_d5`` is the chain with gamma 4. ``dynamic:D``: EAGLE-2 style, expand the best K nodes per
    level for N levels, then keep the D - 1 drafts of highest cumulative draft probability."""

    depth: int
    branching: int
    budget: int
    dynamic: bool = False

    @classmethod
    def parse(cls, text: str) -> "TreeShape":
        import re

        match = re.fullmatch(r"s(\d+)_k(\d+)_d(\d+)", text)
        if match:
            shape = cls(*(int(g) for g in match.groups()))
            if shape.depth < 1 or shape.branching < 1 or not shape.depth + 1 <= shape.budget <= \
                    shape.depth * shape.branching + 1:
                raise SamplingError(f"tree {text!r}: need depth >= 1, branching >= 1 and depth + 1 <= D <= "
                                    "depth * branching + 1")
            return shape
        match = re.fullmatch(r"dynamic:(\d+)", text)
        if match:
            budget = int(match.group(1))
            if not 2 <= budget <= 65:
                raise SamplingError(f"tree {text!r}: the budget D must be in 2..65")
            return cls(min(DYNAMIC_TREE_DEPTH, budget - 1), DYNAMIC_TREE_TOPK, budget, dynamic=True)
        raise SamplingError(f"cannot parse tree shape {text!r}; use sN_kK_dD (e.g. s3_k2_d6) or dynamic:D")

    @property
    def num_drafts(self) -> int:
        return self.budget - 1

    @property
    def cache_positions(self) -> int:
        """The most positions one round of this shape writes past the committed context: its nodes in
        the target's cache, or the levels a dynamic tree stages in the draft's (``branching`` per level)."""
        staged = self.branching * (self.depth - 1) if self.dynamic else self.depth - 1
        return max(self.num_drafts, staged) + 1


@dataclass(frozen=True)
class SpecConfig:
    method: Method = "chain"
    gamma: int = 4  # chain drafts per round (the maximum, for adaptive policies)
    gamma_policy: GammaPolicy = "fixed"  # adaptive: from measured costs and acceptance; hf: +2 / -1
    tree: str = "s3_k2_d6"  # tree shape, method "tree" only
    sibling_mode: SiblingMode = "deterministic"  # how a tree's siblings are drawn (sampling only)
    drafter: DrafterKind = "model"  # where drafts come from: a draft model or n-gram lookup
    ngram_max: int = 4
    ngram_min: int = 1
    exit_layer: int = 2  # early_exit: layers that draft
    lookup: int = 0  # chains: >= 1 drafts a round from a repeat of the context's last `lookup`+ tokens first
    lookup_drafts: int = 0  # with lookup: a round drafted from a repeat drafts up to this many (0: the round's gamma)
    draft_vocab: int | None = None  # draft model: propose only token ids < N (None: its whole vocabulary)
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self):
        if self.method not in METHODS:
            raise SamplingError(f"unknown method {self.method!r}; choose one of {', '.join(METHODS)}")
        if self.method == "chain" and not 1 <= self.gamma <= 64:
            raise SamplingError(f"gamma must be in 1..64, got {self.gamma}")
        if self.sibling_mode not in SIBLING_MODES:
            raise SamplingError(f"unknown sibling mode {self.sibling_mode!r}; choose one of {', '.join(SIBLING_MODES)}")
        if self.gamma_policy not in GAMMA_POLICIES:
            raise SamplingError(f"unknown gamma policy {self.gamma_policy!r}; choose one of {', '.join(GAMMA_POLICIES)}")
        if self.drafter not in DRAFTER_KINDS:
            raise SamplingError(f"unknown drafter {self.drafter!r}; choose one of {', '.join(DRAFTER_KINDS)}")
        if self.draft_vocab is not None and self.draft_vocab < 1:
            raise SamplingError(f"draft_vocab must be >= 1 (or None for the whole vocabulary), got {self.draft_vocab}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise SamplingError(f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min}, {self.ngram_max}")
        if self.lookup < 0:
            raise SamplingError(f"lookup must be >= 0 (0: off), got {self.lookup}")
        if not 0 <= self.lookup_drafts <= 64:
            raise SamplingError(f"lookup_drafts must be in 0..64 (0: the round's gamma), got {self.lookup_drafts}")
        if self.lookup_drafts and not self.lookup:
            raise SamplingError("--lookup-drafts sets how far a lookup drafts; it needs --lookup N")
        if self.lookup and (self.method != "chain" or self.drafter == "ngram"):
            raise SamplingError("--lookup puts a context lookup before a chain's drafter (model, self or eagle); "
                                "drop --lookup" + (" or --tree" if self.method == "tree" else ""))
        if self.drafter == "early_exit" and self.method == "tree":
            raise SamplingError("self-speculation (early exit) drafts chains only; drop --tree")
        if self.method == "tree":
            shape = self.tree_shape
            if shape.dynamic and self.sibling_mode != "deterministic":
                raise SamplingError("dynamic trees keep the top-scoring nodes, which only the deterministic "
                                    "sibling mode verifies losslessly; use --sibling-mode deterministic")

    @property
    def tree_shape(self) -> TreeShape:
        return TreeShape.parse(self.tree)

    @property
    def max_drafts(self) -> int:
        """Draft nodes verified per round: gamma for chains, D - 1 for trees, 0 when off."""
        if self.method == "chain":
            return self.gamma
        if self.method == "tree":
            return self.tree_shape.num_drafts
        return 0

    @property
    def widest_chain(self) -> int:
        """The most drafts a round may verify: ``max_drafts``, or more where a lookup drafts further
        (``lookup_drafts``); what caches are sized for."""
        return max(self.max_drafts, self.lookup_drafts if self.lookup else 0)

    @property
    def enabled(self) -> bool:
        return self.method != "none"
