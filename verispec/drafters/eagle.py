"""Feature-level drafting: an EAGLE-style head (``models.eagle``) drafts from the target's own features.

The target hands over, from passes it runs anyway (the prefill and each verification), the final-normed
hidden state of every token it commits (``observe``). The head keeps one KV cache of its single layer
over "pairs": pair i is (feature of committed token i, embedding of committed token i + 1), at rotary
position i. Features are known for every committed token but the last (the round's recovered or bonus
token, which the next verification feeds), so before drafting the head has pairs 0 .. n - 2 for a
context of n tokens. ``propose`` feeds the pairs it has not seen yet in one pass, then drafts
autoregressively on its own normalised predictions, staging those pairs after the committed ones and
dropping them afterwards:

    round: feed pairs (f_(n-1-a) .. f_(n-2)) -> g; x1 ~ head(g); pair (g, x1) -> g'; x2 ~ head(g'); ...

q is the head's distribution over its first ``draft_vocab`` ids (the rest zero), with every sampling
transform applied as to the target: lossless for any head. Trees: ``propose_tree`` grows static trees
along their main path and dynamic ones level by level, each level's nodes one pass through the layer
with a tree mask over the staged levels (as the draft model's dynamic trees do).
"""

from __future__ import annotations

import math
import time

import torch

from verispec.cache import KVCache
from verispec.config import SamplingParams, SiblingMode, TreeShape
from verispec.drafters.base import DrafterBase, Proposal
from verispec.drafters.draft_model import best_pool_nodes, expand_level, level_mask, pool_tree_proposal, static_tree
from verispec.models.eagle import EagleHead
from verispec.sampling import draw_draft


class EagleDrafter(DrafterBase):
    wants_features = True

    def __init__(self, head: EagleHead, max_len: int):
        self.head, self.max_len = head, max_len
        self.cache: KVCache | None = None
        self.pending: list[torch.Tensor] = []  # (n, H) features of committed tokens not yet paired
        self.paired = 0  # pairs committed to the head's cache
        self.prompt_s = self.backlog_s = 0.0
        self.read_tokens = 0

    def reset(self) -> None:
        if self.cache is None:
            self.cache = self.head.body.new_cache(1, self.max_len)
        self.cache.set_length(0, 0)
        self.pending, self.paired = [], 0

    def observe(self, features: torch.Tensor) -> None:
        """Features (n, H) of the next n committed tokens, in order (the prefill's: every prompt token)."""
        self.pending.append(features.detach().reshape(-1, features.shape[-1]))

    def commit(self, context: list[int]) -> None:
        """Nothing to roll back: drafted pairs are staged and dropped within ``propose``."""

    def unread(self, context: list[int]) -> int:
        """Pairs of committed tokens ``_catch_up`` would feed beyond the last one (a round leaves its
        accepted tokens' and the bonus token's)."""
        return max(0, len(context) - 2 - self.paired)

    # ---- the head's steps ----------------------------------------------------------------------------

    def _step(self, features: torch.Tensor, tokens: list[int], tree_mask: torch.Tensor | None = None,
              depths: torch.Tensor | None = None, staged: int = 0) -> torch.Tensor:
        """Pairs (features (T, H), tokens (T,)) through the layer after the cache's slots; normalised
        predicted features (T, H). Writes the pairs' KV at the cache's length (not committed)."""
        return self.head.step(features[None], torch.tensor([tokens]), self.cache, tree_mask, depths, staged)[0]

    def _catch_up(self, context: list[int]) -> torch.Tensor:
        """Feed the pairs of newly committed tokens; the normalised prediction at the last one (H,)."""
        features = torch.cat(self.pending) if len(self.pending) > 1 else self.pending[0]
        count = features.shape[0]
        if self.paired + count != len(context) - 1:
            raise RuntimeError(f"the EAGLE head holds {self.paired} pairs and got {count} new features for a "
                               f"context of {len(context)} tokens; the engine must observe every committed token")
        began, fresh = time.perf_counter(), self.paired == 0
        predicted = self._step(features, context[self.paired + 1:])
        self.cache.commit(0, count)
        self.paired += count
        self.pending = []
        # The prompt's pairs are a cost of speculating at all (as a draft model's prompt read); a
        # round's own 1 + accepted pairs are part of its drafting.
        self.prompt_s = time.perf_counter() - began if fresh else 0.0
        self.read_tokens = count if fresh else 0
        return predicted[-1]

    def _logits(self, normed: torch.Tensor) -> torch.Tensor:
        return self.head.body.head_logits(normed, self.head.draft_vocab)

    @torch.inference_mode()
    def propose(self, context: list[int], num_drafts: int, sampling: SamplingParams,
                generator: torch.Generator) -> Proposal:
        normed = self._catch_up(context)
        base = self.cache.lengths[0]
        num_drafts = max(0, min(num_drafts, self.cache.max_len - base))
        tokens, probs = [], []
        try:
            for step in range(num_drafts):
                token, step_probs = draw_draft(self._logits(normed[None])[0].cpu(), sampling, generator)
                tokens.append(token)
                if step_probs is not None:
                    probs.append(step_probs)
                if step + 1 < num_drafts:
                    normed = self._step(normed[None], [token])[-1]
                    self.cache.commit(0, 1)
        finally:
            self.cache.set_length(0, base)
        return Proposal(torch.tensor(tokens, dtype=torch.long), torch.stack(probs) if probs else None)

    @torch.inference_mode()
    def propose_tree(self, context: list[int], shape: TreeShape, mode: SiblingMode, sampling: SamplingParams,
                     generator: torch.Generator) -> Proposal:
        """A static sN_kK_dD tree (siblings drawn per ``mode`` around a main path that the head
        follows) or a dynamic:D one (EAGLE-2: expand the ``branching`` nodes of highest cumulative head
        probability per level, keep the budget's best; deterministic siblings)."""
        if sampling.greedy:
            mode = "deterministic"
        normed = self._catch_up(context)
        base = self.cache.lengths[0]
        try:
            if shape.dynamic:
                return self._dynamic_tree(context, shape, normed, base, sampling.guide)
            path = [normed]  # the main path's predicted features: the next level grows from the last

            def advance(token: int) -> torch.Tensor:
                path.append(self._step(path[-1][None], [token])[-1])
                self.cache.commit(0, 1)
                return self._logits(path[-1][None])[0].cpu()

            return static_tree(context[-1], shape, mode, sampling, generator,
                               self._logits(normed[None])[0].cpu(), advance)
        finally:
            self.cache.set_length(0, base)

    def _dynamic_tree(self, context: list[int], shape: TreeShape, root: torch.Tensor, base: int,
                      guide=None) -> Proposal:
        # pool entries: (parent pool index, token, cumulative log probability, depth)
        pool: list[tuple[int, int, float, int]] = [(-1, context[-1], 0.0, 0)]
        features = {0: root}
        frontier = [0]
        frontier_probs = [torch.softmax(self._logits(root[None])[0].float(), -1).cpu()]
        staged: list[int] = []  # pool indices whose pairs sit after the committed ones, in slot order

        def child(node: int, token: int, prob: float, rank: int) -> tuple:
            return (node, token, pool[node][2] + math.log(max(prob, 1e-30)), pool[node][3] + 1)

        for step in range(shape.depth):
            candidates = expand_level(pool, frontier, frontier_probs, shape.branching, guide, child)
            if step == shape.depth - 1 or not candidates:
                break
            frontier = sorted(candidates, key=lambda i: -pool[i][2])[:shape.branching]
            mask, depths = level_mask(pool, frontier, staged)
            inputs = torch.stack([features[pool[node][0]] for node in frontier])
            predicted = self._step(inputs, [pool[node][1] for node in frontier], tree_mask=mask, depths=depths,
                                   staged=len(staged))
            self.cache.commit(0, len(frontier))
            staged += frontier
            for node, row in zip(frontier, predicted):
                features[node] = row
            frontier_probs = list(torch.softmax(self._logits(predicted).float(), -1).cpu())
        return pool_tree_proposal(pool, best_pool_nodes(pool, shape.num_drafts))
