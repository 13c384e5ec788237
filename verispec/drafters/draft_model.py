"""A small draft model proposing a chain, autoregressively, with its own KV cache.

Its cache follows the committed path like the target's: after a round that accepted a of K drafts it
keeps the committed context plus x_1..x_min(a, K-1) (x_K was never fed to it; a rejected x_(a+1) is
dropped even though it sits in the slot the recovered token will take), and the next propose feeds
whatever committed tokens it has not yet seen, starting with the previous round's recovered or bonus
token.
"""

from __future__ import annotations

import torch

from verispec.config import SamplingParams
from verispec.drafters.base import Proposal
from verispec.models.llama import LlamaForCausalLM
from verispec.sampling import logits_to_probs, sample_from


class DraftModelDrafter:
    def __init__(self, model: LlamaForCausalLM, max_len: int | None = None):
        self.model = model
        self.max_len = max_len or model.config.max_context
        self.cache = model.new_cache(1, self.max_len)
        self.seen: list[int] = []  # tokens whose KV is committed in self.cache

    def reset(self) -> None:
        self.cache.reset()
        self.seen = []

    def propose(self, context: list[int], num_drafts: int, sampling: SamplingParams,
                generator: torch.Generator) -> Proposal:
        assert context[:len(self.seen)] == self.seen, "draft cache diverged from the committed context"
        room = self.max_len - len(context)
        num_drafts = max(0, min(num_drafts, room))
        feed = context[len(self.seen):]
        tokens, probs = [], []
        for step in range(num_drafts):
            logits = self.model.forward(torch.tensor([feed]), self.cache, last_only=True)[0, -1]
            self.cache.commit(0, len(feed))
            self.seen.extend(feed)
            if sampling.greedy:  # a point mass on the argmax: no probabilities needed
                token = int(logits.argmax())
            else:
                step_probs = logits_to_probs(logits, sampling)
                token = sample_from(step_probs, generator)
                probs.append(step_probs)
            tokens.append(token)
            feed = [token]
        return Proposal(torch.tensor(tokens, dtype=torch.long), torch.stack(probs) if probs else None)

    def commit(self, context: list[int]) -> None:
        """``context`` is now the committed sequence: keep only the KV of its tokens we have seen."""
        # Always leave the last committed token unseen: its logits are what the next propose needs.
        keep = min(_common_prefix_length(self.seen, context), len(context) - 1)
        self.seen = self.seen[:keep]
        self.cache.set_length(0, keep)


def _common_prefix_length(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
