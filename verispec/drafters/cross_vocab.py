"""A draft model with its own tokenizer drafting for the target through a ``VocabBridge``.

Each round the committed target ids are turned into text and re-tokenized by the draft's tokenizer; the
draft's cache keeps the KV of the draft tokens that did not change (re-tokenizing can redo the last few).
Every draft step turns the draft's logits into logits over the target's ids (-inf outside the shared
tokens) and draws from them under the request's sampling transforms, so each draft is a target id and
its q a row over the target's vocabulary: verification is exact whatever the draft knows. A drafted
token is fed to the draft by its own id. Chains and static trees; a draft context past the draft's
positions drafts nothing.
"""

from __future__ import annotations

import torch

from verispec.config import SamplingParams, SiblingMode, TreeShape
from verispec.drafters.base import Proposal
from verispec.drafters.draft_model import DraftModelDrafter, static_tree
from verispec.errors import VerispecError
from verispec.models.llama import LlamaForCausalLM
from verispec.sampling import draw_draft
from verispec.vocab import VocabBridge


class CrossVocabDrafter(DraftModelDrafter):
    """``DraftModelDrafter`` over another tokenizer: its cache and ``seen`` hold the draft's own ids."""

    def __init__(self, model: LlamaForCausalLM, bridge: VocabBridge, vocab_limit: int | None = None):
        super().__init__(model, vocab_limit=vocab_limit)
        self.bridge = bridge
        self.max_context = None  # its limit is in its own tokens: checked per round

    def _start(self, context: list[int], needed: int) -> torch.Tensor | None:
        """Sync the draft's cache with the committed text; the target-vocabulary logits after it, or
        None when the draft has no room for ``needed`` more tokens (or no text to read)."""
        ids = self.bridge.draft_context(context)
        if not ids or len(ids) + needed > self.max_len:
            return None
        super().commit(ids)  # keep the KV of the unchanged draft tokens (the last one is re-fed)
        return self.bridge.spread(self._catch_up(ids))

    def propose(self, context: list[int], num_drafts: int, sampling: SamplingParams,
                generator: torch.Generator) -> Proposal:
        logits = self._start(context, num_drafts) if num_drafts > 0 else None
        tokens, probs, draft_id = [], [], -1
        for step in range(num_drafts if logits is not None else 0):
            if step:  # the previous step's draft, in the draft's own ids
                logits = self.bridge.spread(self._feed([draft_id]))
            token, step_probs = draw_draft(logits, sampling, generator)
            tokens.append(token)
            if step_probs is not None:
                probs.append(step_probs)
            draft_id = int(self.bridge.to_draft[token])
            if draft_id < 0:  # a token only the target has (a grammar's fallback): the draft cannot read on
                break
        return Proposal(torch.tensor(tokens, dtype=torch.long), torch.stack(probs) if probs else None)

    def propose_tree(self, context: list[int], shape: TreeShape, mode: SiblingMode, sampling: SamplingParams,
                     generator: torch.Generator) -> Proposal:
        """A static tree (children drawn per ``mode`` from the shared tokens); a chain when the draft
        lacks the room."""
        if shape.dynamic:
            raise VerispecError("a draft with another tokenizer drafts chains and static trees; use a static "
                                "shape such as --tree s3_k2_d6")
        if sampling.guide is not None and sampling.guide.constraint is not None:
            raise VerispecError("a draft with another tokenizer drafts trees without a grammar; drop --tree "
                                "(chains keep the grammar)")
        if sampling.greedy:
            mode = "deterministic"
        logits = self._start(context, shape.depth)
        if logits is None:
            return self.propose(context, 0, sampling, generator)
        return static_tree(context[-1], shape, mode, sampling, generator, logits,
                           lambda token: self.bridge.spread(self._feed([int(self.bridge.to_draft[token])])))

    def commit(self, context: list[int]) -> None:
        """Nothing to do yet: the next ``propose`` re-tokenizes the committed text and keeps what it can."""
