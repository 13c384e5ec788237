"""Lookup first: a round whose context repeats itself drafts the repeat (prompt lookup), any other round
asks the drafter behind it (a draft model, an EAGLE head, the target's early layers).

Code, edits and answers that quote their question repeat long runs of earlier tokens; there a lookup
guesses better than a small drafter, at no cost. Elsewhere a lookup of one or two tokens guesses badly
while the drafter guesses well. So a round looks up the last ``max_n`` .. ``min_n`` tokens (``min_n``
at least 2 by default: one shared token is weak evidence) and, on a match, proposes the tokens that
followed it as point masses; without a match the inner drafter proposes as usual.

    drafter = LookupFirst(EagleDrafter(head, max_len), min_n=3)

Lossless whatever it proposes: each round's proposal describes what it did (point masses, or the inner
drafter's q), and the verifier handles both. The inner drafter skips the looked-up rounds and catches
up on the tokens committed meanwhile at its next proposal (``unread``), as after rounds at gamma 0.
"""

from __future__ import annotations

import torch

from verispec.config import SamplingParams
from verispec.drafters.base import Drafter, DrafterBase, DraftReads, Proposal
from verispec.drafters.ngram import NgramDrafter

DEFAULT_MIN_N = 3  # the shortest repeat drafted from (experiments/lookup_first.py compares 2 and 3)
LOOKUP_MAX_N = 8  # the longest pattern looked up: the longest match wins


class LookupFirst(DrafterBase):
    def __init__(self, inner: Drafter, min_n: int = DEFAULT_MIN_N, max_n: int = LOOKUP_MAX_N,
                 lookup_drafts: int = 0):
        """``lookup_drafts``: a lookup drafts up to this many or the round's number, the larger
        (``--lookup-drafts``; the engine cuts a proposal to what the request can still commit); the inner
        drafter always drafts the round's number."""
        self.inner, self.lookup_drafts = inner, lookup_drafts
        self.lookup = repeat_finder(min_n, max_n)
        self.shares_target_cache = inner.shares_target_cache
        self.wants_features = inner.wants_features
        self.max_context = inner.max_context
        self.looked_up = False  # whether the last proposal came from the lookup
        self.lookups = 0  # rounds drafted by lookup since reset

    def reset(self) -> None:
        self.inner.reset()
        self.looked_up, self.lookups = False, 0

    def bind(self, cache) -> None:
        self.inner.bind(cache)

    def observe(self, features: torch.Tensor) -> None:
        self.inner.observe(features)

    def commit(self, context: list[int]) -> None:
        self.inner.commit(context)

    def unread(self, context: list[int]) -> int:
        return self.inner.unread(context)

    def reads(self) -> DraftReads:
        return DraftReads() if self.looked_up else self.inner.reads()

    def propose(self, context: list[int], num_drafts: int, sampling: SamplingParams,
                generator: torch.Generator) -> Proposal:
        repeat = self.lookup.lookup(context, max(num_drafts, self.lookup_drafts)) if num_drafts > 0 else []
        self.looked_up = bool(repeat)
        if repeat:
            self.lookups += 1
            return Proposal(torch.tensor(repeat, dtype=torch.long), None)
        return self.inner.propose(context, num_drafts, sampling, generator)


def repeat_finder(min_n: int, max_n: int = LOOKUP_MAX_N) -> NgramDrafter:
    """What looks up a context's repeats of ``min_n``.. ``max_n`` tokens (longest, then most recent)."""
    return NgramDrafter(max_n=max(max_n, min_n), min_n=min_n)


def behind_lookup(drafter: Drafter, lookup: int, lookup_drafts: int = 0) -> Drafter:
    """``drafter`` behind a lookup of repeats of ``lookup``+ tokens (``SpecConfig.lookup``) that drafts up
    to ``lookup_drafts`` (``SpecConfig.lookup_drafts``; 0: the round's number); unchanged for lookup 0."""
    return LookupFirst(drafter, min_n=lookup, lookup_drafts=lookup_drafts) if lookup else drafter
