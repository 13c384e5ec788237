"""Self-speculation (LayerSkip): the target's first E layers + final norm + LM head draft, the full
model verifies, and the KV the early layers wrote while drafting is reused by the verify pass.

The drafter works in the target's own cache (``bind``). Drafting K tokens feeds the root (the last
committed token) and x_1..x_(K-1) through layers 0..E-1, one at a time, leaving their early-layer KV in
the slots right after the committed prefix and keeping each one's hidden state after layer E. The
engine's verify pass then runs only x_K through the early layers and resumes every position at layer
E (see ``SpecEngine`` / ``Generation._resume_from_exit``). Nothing is committed here: a rejected draft's
early-layer KV sits beyond the committed length and is overwritten later.

Only models trained for early exit (layer dropout + early-exit loss) draft well from their early
layers; a target trained without that recipe is a measured counter-example (docs/model-card.md), not
an assumption.
"""

from __future__ import annotations

import torch

from verispec.cache import KVCache
from verispec.config import SamplingParams
from verispec.drafters.base import DrafterBase, Proposal
from verispec.errors import VerispecError
from verispec.models.llama import LlamaForCausalLM
from verispec.sampling import draw_draft


class EarlyExitDrafter(DrafterBase):
    shares_target_cache = True

    def __init__(self, model: LlamaForCausalLM, exit_layer: int):
        layers = model.config.num_hidden_layers
        if not 1 <= exit_layer < layers:
            raise VerispecError(f"--exit-layer must be in 1..{layers - 1} for this {layers}-layer target, "
                                f"got {exit_layer}")
        self.model, self.exit_layer = model, exit_layer
        self.cache: KVCache | None = None

    def bind(self, cache: KVCache) -> None:
        self.cache = cache

    def reset(self) -> None:
        self.cache = None

    def commit(self, context: list[int]) -> None:
        """The engine commits the shared cache; nothing of our own to roll back."""

    @torch.inference_mode()  # the layers return inference tensors; the head must not record them for autograd
    def propose(self, context: list[int], num_drafts: int, sampling: SamplingParams,
                generator: torch.Generator) -> Proposal:
        assert self.cache is not None, "bind() the target cache first"
        model, cache = self.model, self.cache
        base = cache.lengths[0]
        num_drafts = max(0, min(num_drafts, cache.max_len - base - 1))
        fed, tokens, probs, exit_hidden = context[-1], [], [], []
        try:
            for _ in range(num_drafts):
                hidden = model.run_layers(model.embed(torch.tensor([[fed]])), cache, 0,
                                          self.exit_layer)[0, -1]  # (H,)
                cache.commit(0, 1)
                exit_hidden.append(hidden)
                fed, step_probs = draw_draft(model.logits(hidden).cpu(), sampling, generator)
                tokens.append(fed)
                if step_probs is not None:
                    probs.append(step_probs)
        finally:
            cache.set_length(0, base)  # drafted slots are staged, never committed here
        hidden = torch.stack(exit_hidden)[None] if exit_hidden else None  # (1, K, H)
        return Proposal(torch.tensor(tokens, dtype=torch.long), torch.stack(probs) if probs else None,
                        exit_hidden=hidden, exit_layer=self.exit_layer)
