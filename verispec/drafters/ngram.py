"""Model-free drafting by n-gram lookup in the context (prompt lookup decoding).

Take the last n tokens of the context (n from ``max_n`` down to ``min_n``), find their most recent
earlier occurrence, and propose the tokens that followed it. Drafts are point masses (q is one-hot),
which the chain and deterministic-tree verifiers handle losslessly under any sampling settings.

    >>> drafter = NgramDrafter(max_n=3, min_n=1)
    >>> drafter.lookup([5, 6, 7, 8, 9, 5, 6, 7], num_drafts=2)
    [8, 9]

For trees, up to ``branching`` distinct continuations (from different occurrences, longest n first)
are merged into a trie, so siblings are distinct tokens.
"""

from __future__ import annotations

import torch

from verispec.config import SamplingParams, SiblingMode, TreeShape
from verispec.drafters.base import DrafterBase, Proposal
from verispec.tree import TokenTree

DEFAULT_MAX_N, DEFAULT_MIN_N = 4, 1


class NgramDrafter(DrafterBase):
    def __init__(self, max_n: int = DEFAULT_MAX_N, min_n: int = DEFAULT_MIN_N):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.max_n, self.min_n = max_n, min_n

    def reset(self) -> None:
        """Stateless: the context is searched afresh each round."""

    def commit(self, context: list[int]) -> None:
        """Stateless: nothing to roll back."""

    def lookup(self, context: list[int], num_drafts: int) -> list[int]:
        for continuation in self._continuations(context, num_drafts, limit=1):
            return continuation
        return []

    def propose(self, context: list[int], num_drafts: int, sampling: SamplingParams,
                generator: torch.Generator) -> Proposal:
        return Proposal(torch.tensor(self.lookup(context, num_drafts), dtype=torch.long), None)

    def propose_tree(self, context: list[int], shape: TreeShape, mode: SiblingMode, sampling: SamplingParams,
                     generator: torch.Generator) -> Proposal:
        parents, tokens = [-1], [context[-1]]
        child_of: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
        for continuation in self._continuations(context, shape.depth, limit=shape.branching):
            node = 0
            for token in continuation:
                if (node, token) not in child_of:
                    if len(tokens) > shape.num_drafts:
                        break
                    child_of[(node, token)] = len(tokens)
                    parents.append(node)
                    tokens.append(token)
                node = child_of[(node, token)]
        tree = TokenTree(parents=parents, tokens=tokens)  # trie insertion order is parent-first
        return Proposal(torch.tensor(tree.tokens[1:], dtype=torch.long), None, tree)

    def _continuations(self, context: list[int], length: int, limit: int):
        """Distinct continuations of up to ``length`` tokens, longest matching n first, then most recent."""
        if len(context) < 2:
            return
        found: set[tuple[int, ...]] = set()
        last = context[-1]
        # An earlier occurrence of any pattern ends on a copy of the last token: only those places are
        # compared (most recent first), one pass over the context instead of one per pattern length.
        ends = [end for end in range(len(context) - 2, -1, -1) if context[end] == last]
        for n in range(min(self.max_n, len(context) - 1), self.min_n - 1, -1):
            pattern = context[-n:]
            for start in (end - n + 1 for end in ends if end >= n - 1):
                if context[start:start + n] == pattern:
                    continuation = tuple(context[start + n:start + n + length])
                    if continuation and continuation not in found:
                        found.add(continuation)
                        yield list(continuation)
                        if len(found) >= limit:
                            return

