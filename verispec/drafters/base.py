"""The proposer interface (in the spirit of HF's candidate generators): propose, then learn what was kept.

A round, from the engine's side:

    proposal = drafter.propose(context, num_drafts=4, sampling=params, generator=g)
    ...target verifies, commits num_accepted drafts plus one recovered/bonus token...
    drafter.commit(new_context)   # drafter rolls its own state back to the committed tokens

``context`` is every committed token of the sequence (prompt + generated); its last token is the one
whose successor is being drafted. ``proposal.probs`` must describe what the drafter actually did: the
transformed distribution each draft was sampled from, or None for point-mass (greedy, lookup) drafts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from verispec.config import SamplingParams
from verispec.tree import TokenTree


@dataclass(frozen=True)
class Proposal:
    tokens: torch.Tensor  # (K,) int64; for a tree, the draft nodes' tokens in node order
    probs: torch.Tensor | None  # (K, V) float32, or None: point masses on `tokens` (chains only)
    tree: TokenTree | None = None  # set for tree proposals: parents, tokens, draft_probs
    # Early exit: hidden states (1, K, H) after layer exit_layer of the root and x_1..x_(K-1), whose
    # early-layer KV already sits in the target cache; verification resumes from them.
    exit_hidden: torch.Tensor | None = None
    exit_layer: int = 0

    @property
    def num_drafts(self) -> int:
        return int(self.tokens.shape[0])


class Drafter(Protocol):
    def propose(self, context: list[int], num_drafts: int, sampling: SamplingParams,
                generator: torch.Generator) -> Proposal: ...

    def commit(self, context: list[int]) -> None: ...

    def reset(self) -> None: ...


def head_args(vocab_limit: int | None) -> dict:
    """Keyword arguments for a draft model's logits: ``vocab_limit`` only when set, so a model without
    that parameter (a transformers adapter) is called as before."""
    return {"vocab_limit": vocab_limit} if vocab_limit is not None else {}


def common_prefix_length(a: list[int], b: list[int]) -> int:
    """How many leading tokens two sequences share: how much of a drafter's cache stays valid."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the usual case (a cache that is a prefix of the context): one C-level compare
        return n
    low, high = 0, n - 1  # a[:low] == b[:low] and a[:high + 1] != b[:high + 1]
    while low < high:
        middle = (low + high + 1) // 2
        if a[:middle] == b[:middle]:
            low = middle
        else:
            high = middle - 1
    return low
