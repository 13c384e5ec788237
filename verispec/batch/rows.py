"""Rows that draft with a drafter of their own (any ``Drafter``: a draft model's trees, n-gram lookup,
self-speculation, an EAGLE head), and one target pass that verifies chains and trees of several rows.

Each such row proposes in turn with its own drafter and generator, in the order ``SpecEngine`` does, so a
request decodes the same alone or in a batch. Their drafts are then verified together: every row feeds
its root (the last committed token) and its nodes, padded to the longest row; a row's tree mask lets a
node see only its ancestors, and each row's depths place its nodes after its own committed length.
Drafters are pooled: a finished row's drafter is reset and serves the next request (caches are not
reallocated per request).
"""

from __future__ import annotations

from typing import Callable

import torch

from verispec.batch.requests import Row
from verispec.config import SpecConfig
from verispec.drafters import DraftModelDrafter, EarlyExitDrafter, NgramDrafter
from verispec.drafters.base import Drafter, Proposal, check_drafter
from verispec.drafters.eagle import EagleDrafter
from verispec.drafters.lookup_first import behind_lookup
from verispec.grammar import FORCED_DRAFTS
from verispec.guide import with_point_masses
from verispec.tree import TokenTree, use_tree


class RowDrafters:
    """A pool of drafters built by ``make``, one lent to each running row."""

    def __init__(self, make: Callable[[], Drafter]):
        self.make, self.free = make, []

    def acquire(self) -> Drafter:
        drafter = self.free.pop() if self.free else self.make()
        check_drafter(drafter)
        drafter.reset()
        return drafter

    def release(self, drafter: Drafter) -> None:
        self.free.append(drafter)


def drafter_maker(spec: SpecConfig, target, draft, eagle, cache_len: int) -> Callable[[], Drafter]:
    """What builds each row's own drafter for ``spec`` (behind a lookup with ``--lookup``)."""
    make = {"ngram": lambda: NgramDrafter(spec.ngram_max, spec.ngram_min),
            "early_exit": lambda: EarlyExitDrafter(target, spec.exit_layer),
            "eagle": lambda: EagleDrafter(eagle, cache_len),
            "model": lambda: DraftModelDrafter(draft, cache_len, vocab_limit=spec.draft_vocab)}[spec.drafter]
    return (lambda: behind_lookup(make(), spec.lookup, spec.lookup_drafts)) if spec.lookup else make


def propose_own(sequence: Row, spec: SpecConfig, num_drafts: int, room: int, bind_view) -> Proposal:
    """This round's proposal from the row's own drafter: a tree of the spec's shape where the cache room
    takes one (``tree.use_tree``), cut to the depth the remaining tokens can commit, else a chain of
    ``num_drafts`` (a lookup's may be longer: cut to the remaining tokens and the cache room)."""
    drafter, params = sequence.drafter, sequence.request.sampling
    if drafter.shares_target_cache:
        drafter.bind(bind_view())
    if spec.method == "tree" and num_drafts > 0 and use_tree(spec.tree_shape, room):
        mode = "deterministic" if params.greedy else spec.sibling_mode
        return drafter.propose_tree(sequence.context, spec.tree_shape, mode, params,
                                    sequence.generator).capped(sequence.remaining)
    if num_drafts <= 0:
        return Proposal(torch.empty(0, dtype=torch.long), None)
    proposal = drafter.propose(sequence.context, num_drafts, params, sequence.generator)
    return proposal.capped(min(sequence.remaining, room))


def tree_inputs(roots: list[int], drafts: list[list[int]], trees: list[TokenTree | None]
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fed ids (B, W), tree masks (B, W, W) and depths (B, W) for rows whose round is a chain (root then
    drafts, causal) or a tree (its nodes and ancestor mask), padded to the widest: a padding position
    sees only itself and its output is never read."""
    widths = [len(t.tokens) if t is not None else 1 + len(d) for d, t in zip(drafts, trees)]
    width = max(widths)
    fed = torch.empty(len(roots), width, dtype=torch.long)
    masks = torch.eye(width, dtype=torch.bool).repeat(len(roots), 1, 1)
    depths = torch.zeros(len(roots), width, dtype=torch.long)
    for row, (root, tokens, tree, used) in enumerate(zip(roots, drafts, trees, widths)):
        ids = tree.tokens if tree is not None else [root] + tokens
        fed[row] = torch.tensor(ids + [root] * (width - used))
        if tree is None:
            masks[row, :used, :used] = torch.ones(used, used, dtype=torch.bool).tril()
            depths[row, :used] = torch.arange(used)
        else:
            buffers = tree.compile()
            masks[row, :used, :used] = buffers.ancestor_mask
            depths[row, :used] = buffers.depths
    return fed, masks, depths


def guide_rows(rows: list[Row], drafts: list[list[int]], draft_probs: list[torch.Tensor | None],
               trees: list[TokenTree | None], max_len: int) -> list:
    """For chain rows under a grammar: their drafts cut at the first one it forbids and its forced tokens
    appended as free drafts (``drafts`` and ``draft_probs`` changed in place), and the masks (k + 1, V) of
    the rows that verify them; None for the other rows (a tree's masks are built when it is verified)."""
    masks = []
    for row, sequence in enumerate(rows):
        guide = sequence.request.sampling.guide
        if guide is None or trees[row] is not None:
            masks.append(None)
            continue
        count = len(drafts[row])
        room = min(FORCED_DRAFTS, sequence.remaining - 1 - count, max_len - len(sequence.context) - 1 - count)
        allowed, forced, row_masks = guide.round_masks(drafts[row], max(0, room))
        del drafts[row][allowed:]
        if draft_probs[row] is not None:
            draft_probs[row] = draft_probs[row][:allowed] if allowed else None
        draft_probs[row] = with_point_masses(draft_probs[row], forced)  # free drafts after drawn ones
        drafts[row] += forced
        masks.append(row_masks)
    return masks
