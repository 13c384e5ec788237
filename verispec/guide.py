"""A request's stateful logits transforms: a grammar's mask and the repetition penalties, applied to the
target's rows and the drafter's alike, following every draft of a round and rolled back with it.

    guide = Guide.for_request(sampling, prompt_ids, vocab_size)   # None when there is nothing to do
    row = guide.mask()                  # the transform at the current state: row.apply(logits)
    guide.stage(token)                  # a draft, ahead of the committed tokens
    allowed, forced, rows = guide.round_masks(drafts, forced_limit)   # rows.apply(logits (K + 1, V))
    guide.unstage(); guide.advance(committed)

Both transforms depend on the tokens before a position only, so the target's distribution at a verified
row and the drafter's at the same position get the same transform when both see the round's earlier
drafts; the verifier then corrects the drafts exactly as without them.

Penalties (OpenAI's and vLLM's definitions, applied to the logits before temperature and the filters):
the repetition penalty r divides a positive logit by r and multiplies a negative one by r for every
token in the prompt or the output so far; then ``presence`` is subtracted from every token the output
contains and ``frequency`` times its count. The grammar's mask comes last (-inf wherever it forbids).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from verispec.config import SamplingParams


@dataclass(frozen=True)
class Rows:
    """The transform of one row (tensors (V,)) or of a round's rows ((T, V)); a None part is off."""

    mask: torch.Tensor | None = None  # bool: what the grammar allows
    counts: torch.Tensor | None = None  # float32: the output's token counts (presence, frequency)
    seen: torch.Tensor | None = None  # bool: tokens in the prompt or the output (repetition)
    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits (..., V') transformed; V' <= V (a draft scoring only the first ids gets the first V')."""
        width = logits.shape[-1]
        if self.seen is not None and self.repetition != 1.0:
            seen = self.seen[..., :width].to(logits.device)
            logits = torch.where(seen, torch.where(logits > 0, logits / self.repetition, logits * self.repetition),
                                 logits)
        if self.counts is not None and (self.presence or self.frequency):
            counts = self.counts[..., :width].to(logits.device)
            logits = logits - self.presence * (counts > 0).to(logits.dtype) - self.frequency * counts.to(logits.dtype)
        if self.mask is not None:
            logits = logits.masked_fill(~self.mask[..., :width].to(logits.device), float("-inf"))
        return logits

    def allowed(self) -> torch.Tensor | None:
        return self.mask


def with_point_masses(probs: torch.Tensor | None, tokens: list[int]) -> torch.Tensor | None:
    """Draft q rows (K, V) followed by one-hot rows for ``tokens`` (drafts that are point masses, such as
    the tokens a grammar forces); None (all point masses) stays None."""
    if probs is None or not tokens:
        return probs
    extra = torch.nn.functional.one_hot(torch.tensor(tokens, dtype=torch.long), probs.shape[1]).to(probs.dtype)
    return torch.cat([probs, extra])


class Penalties:
    """Token counts of the output so far (committed, then staged drafts), and what the prompt holds."""

    def __init__(self, sampling: SamplingParams, prompt_ids: list[int], vocab_size: int):
        self.presence, self.frequency = sampling.presence_penalty, sampling.frequency_penalty
        self.repetition, self.vocab_size = sampling.repetition_penalty, vocab_size
        self.prompt = torch.zeros(vocab_size, dtype=torch.bool)
        self.prompt[[t for t in prompt_ids if 0 <= t < vocab_size]] = True
        self.counts = torch.zeros(vocab_size)
        self.staged: list[int] = []

    def rows(self, tokens: list[int], base: torch.Tensor | None = None) -> Rows:
        """Rows (len(tokens) + 1, V): row i after ``tokens[:i]`` on top of ``base`` counts."""
        counts = (self.counts if base is None else base).expand(len(tokens) + 1, -1).clone()
        for i, token in enumerate(tokens):
            if 0 <= token < self.vocab_size:
                counts[i + 1:, token] += 1
        return Rows(None, counts, (counts > 0) | self.prompt, self.presence, self.frequency, self.repetition)

    def row(self, tokens: list[int]) -> Rows:
        """The one row after ``tokens`` (staged drafts, a tree node's path) on top of the output so far."""
        counts = self.counts.clone()
        for token in tokens:
            if 0 <= token < self.vocab_size:
                counts[token] += 1
        return Rows(None, counts, (counts > 0) | self.prompt, self.presence, self.frequency, self.repetition)

    def advance(self, tokens: list[int]) -> None:
        for token in tokens:
            if 0 <= token < self.vocab_size:
                self.counts[token] += 1


def _combine(mask: torch.Tensor | None, penalty: Rows | None) -> Rows:
    if penalty is None:
        return Rows(mask)
    return Rows(mask, penalty.counts, penalty.seen, penalty.presence, penalty.frequency, penalty.repetition)


class Guide:
    """A request's grammar constraint (``verispec.grammar.Constraint``) and penalties, with one staging
    protocol: what the engines and drafters call, whichever of the two is on."""

    def __init__(self, constraint=None, penalties: Penalties | None = None):
        self.constraint, self.penalties = constraint, penalties

    @classmethod
    def for_request(cls, sampling: SamplingParams, prompt_ids: list[int], vocab_size: int) -> "Guide | None":
        """The guide of a request starting now (its constraint reset to the grammar's start), or None."""
        constraint = sampling.guide.constraint if isinstance(sampling.guide, Guide) else sampling.guide
        penalties = Penalties(sampling, prompt_ids, vocab_size) if sampling.penalized else None
        if constraint is None and penalties is None:
            return None
        if constraint is not None:
            constraint.reset()
        return cls(constraint, penalties)

    @property
    def spec(self):
        return None if self.constraint is None else self.constraint.spec

    @property
    def finished(self) -> bool:
        return self.constraint is not None and self.constraint.finished

    def _penalty_rows(self, tokens: list[int]) -> Rows | None:
        return None if self.penalties is None else self.penalties.rows(tokens)

    def mask(self) -> Rows:
        """The transform at the current state (committed tokens, then the staged ones)."""
        penalty = None if self.penalties is None else self.penalties.row(self.penalties.staged)
        return _combine(None if self.constraint is None else self.constraint.mask(), penalty)

    def stage(self, token: int) -> bool:
        if self.constraint is not None and not self.constraint.stage(token):
            return False
        if self.penalties is not None:
            self.penalties.staged.append(token)
        return True

    def round_masks(self, drafts: list[int], forced_limit: int = 0) -> tuple[int, list[int], Rows]:
        """As ``Constraint.round_masks``: drafts allowed, forced tokens, and the rows verifying them."""
        if self.constraint is not None:
            allowed, forced, masks = self.constraint.round_masks(drafts, forced_limit)
        else:
            allowed, forced, masks = len(drafts), [], None
        if self.penalties is not None:
            self.penalties.staged = list(drafts[:allowed]) + forced
        return allowed, forced, _combine(masks, self._penalty_rows(list(drafts[:allowed]) + forced))

    def unstage(self) -> None:
        if self.constraint is not None:
            self.constraint.unstage()
        if self.penalties is not None:
            self.penalties.staged = []

    def advance(self, tokens: list[int]) -> None:
        self.unstage()
        if self.constraint is not None:
            self.constraint.advance(tokens)
        if self.penalties is not None:
            self.penalties.advance(tokens)

    def mask_after(self, path: list[int]) -> torch.Tensor:
        """The grammar's mask after a tree node's path (all True without a grammar): for pruning."""
        if self.constraint is None:
            return torch.ones(self.penalties.vocab_size, dtype=torch.bool)
        return self.constraint.mask_after(path)

    def rows_after(self, path: list[int]) -> Rows:
        """The whole transform after a tree node's path."""
        penalty = None if self.penalties is None else self.penalties.row(path)
        return _combine(None if self.constraint is None else self.constraint.mask_after(path), penalty)

    def tree_masks(self, parents: list[int], tokens: list[int]) -> Rows:
        """Rows (N + 1, V) of a tree: row i the transform after node i's path."""
        masks = None if self.constraint is None else self.constraint.tree_masks(parents, tokens)
        if self.penalties is None:
            return Rows(masks)
        counts = self.penalties.counts.expand(len(tokens), -1).clone()
        for node in range(1, len(tokens)):
            counts[node] = counts[parents[node]]
            if 0 <= tokens[node] < self.penalties.vocab_size:
                counts[node, tokens[node]] += 1
        p = self.penalties
        return Rows(masks, counts, (counts > 0) | p.prompt, p.presence, p.frequency, p.repetition)

    def path_masks(self, tokens: list[int]) -> tuple[Rows, int]:
        """From the request's start: rows (len(tokens) + 1, V) along ``tokens`` and how many the grammar
        allows (as ``Constraint.path_masks``). The output so far counts only ``tokens``."""
        if self.constraint is not None:
            masks, allowed = self.constraint.path_masks(tokens)
        else:
            masks, allowed = None, len(tokens)
        penalty = None if self.penalties is None else self.penalties.rows(tokens, torch.zeros(self.penalties.vocab_size))
        return _combine(masks, penalty), allowed

