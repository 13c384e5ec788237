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

from verispec.config import SamplingParams, SiblingMode, TreeShape
from verispec.errors import VerispecError
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

    def capped(self, remaining: int) -> "Proposal":
        """Cut to what a request with ``remaining`` tokens to generate can commit (its deepest accepted
        path plus one token): a tree to that depth, a chain (a lookup may draft past the round's gamma)
        to ``remaining - 1`` drafts; proposals that fit unchanged."""
        if self.tree is None:
            limit = max(0, remaining - 1)
            if self.num_drafts <= limit:
                return self
            return Proposal(self.tokens[:limit], None if self.probs is None else self.probs[:limit],
                            exit_hidden=None if self.exit_hidden is None else self.exit_hidden[:, :limit],
                            exit_layer=self.exit_layer)
        tree = self.tree.pruned(max(0, remaining - 1))
        return self if tree is self.tree else Proposal(torch.tensor(tree.tokens[1:], dtype=torch.long), None, tree)


@dataclass(frozen=True)
class DraftReads:
    """What a drafter's last ``propose`` spent reading committed tokens it had not yet seen, beyond the
    one or two a round leaves behind: a request's prompt (``prompt_s``, a cost of speculating at all)
    or a later backlog (``backlog_s``, tokens committed while speculation was off); ``tokens`` read."""

    prompt_s: float = 0.0
    backlog_s: float = 0.0
    tokens: int = 0


class Drafter(Protocol):
    """What the engines use of a drafter, and nothing else (``check_drafter`` verifies it once).

    Capabilities: ``shares_target_cache`` (it drafts in the target's own cache: ``bind`` gives it the
    request's cache before the prefill), ``wants_features`` (it reads the target's final features of
    every committed token: ``observe`` gets them from the prefill and each verification, in order),
    ``max_context`` (its own context limit, None for the target's). ``propose_tree`` may raise
    ``VerispecError`` for a drafter that drafts chains only. ``unread(context)``: committed tokens it
    would read before drafting for ``context`` beyond the last one (a backlog after rounds at gamma 0;
    engines price it with the gamma policy's ``afford`` first). ``DrafterBase`` gives the defaults."""

    shares_target_cache: bool
    wants_features: bool
    max_context: int | None

    def propose(self, context: list[int], num_drafts: int, sampling: SamplingParams,
                generator: torch.Generator) -> Proposal: ...

    def propose_tree(self, context: list[int], shape: TreeShape, mode: SiblingMode, sampling: SamplingParams,
                     generator: torch.Generator) -> Proposal: ...

    def commit(self, context: list[int]) -> None: ...

    def reset(self) -> None: ...

    def bind(self, cache) -> None: ...

    def observe(self, features: torch.Tensor) -> None: ...

    def reads(self) -> DraftReads: ...

    def unread(self, context: list[int]) -> int: ...


class DrafterBase:
    """Defaults for the ``Drafter`` protocol: no shared cache, no features, the target's context, chains
    only, no reads beyond a round's own (subclasses set ``prompt_s``, ``backlog_s``, ``read_tokens``)."""

    shares_target_cache = False
    wants_features = False
    max_context: int | None = None
    prompt_s = backlog_s = 0.0
    read_tokens = 0

    def propose_tree(self, context, shape, mode, sampling, generator) -> Proposal:
        raise VerispecError(f"{type(self).__name__} drafts chains only; drop --tree")

    def bind(self, cache) -> None:
        """Only drafters that share the target's cache use it."""

    def observe(self, features: torch.Tensor) -> None:
        """Only feature drafters read the target's features."""

    def reads(self) -> DraftReads:
        return DraftReads(self.prompt_s, self.backlog_s, self.read_tokens)

    def unread(self, context: list[int]) -> int:
        """A drafter with no state of its own (n-gram lookup, the target's early layers) reads nothing."""
        return 0


PROTOCOL_MEMBERS = ("propose", "propose_tree", "commit", "reset", "bind", "observe", "reads", "unread",
                    "shares_target_cache", "wants_features", "max_context")


def check_drafter(drafter) -> None:
    """Raise ``VerispecError`` naming what a drafter lacks of the ``Drafter`` protocol."""
    missing = [name for name in PROTOCOL_MEMBERS if not hasattr(drafter, name)]
    if missing:
        raise VerispecError(f"{type(drafter).__name__} does not implement the Drafter protocol: missing "
                            f"{', '.join(missing)} (subclass verispec.drafters.base.DrafterBase for the defaults)")


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
