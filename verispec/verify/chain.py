"""Chain rejection sampling (Leviathan et al. 2023, section 2.3 and appendix A.1). Pure functions.

Convention of the paper: p is the target's (transformed) distribution, q the drafter's, at the same
prefix, over the same token ids. For draft i (1-based) accept x_i iff u_i < min(1, p_i(x_i) / q_i(x_i));
at the first rejection emit a *recovered* token from norm(max(0, p_i - q_i)) and stop; if all K are
accepted emit a *bonus* token from p_{K+1}. A round commits 1..K+1 tokens.

The worked example of docs/algorithms.md (V = 3: A, B, C = 0, 1, 2), p = (0.5, 0.3, 0.2) and
q = (0.6, 0.1, 0.3) at every position:

    >>> p = torch.tensor([[0.5, 0.3, 0.2]] * 4); q = torch.tensor([[0.6, 0.1, 0.3]] * 3)
    >>> r = verify_chain(draft_tokens=torch.tensor([0, 2, 1]), draft_probs=q, target_probs=p,
    ...                  uniforms=torch.tensor([0.7, 0.9, 0.2]), final_uniform=0.2)
    >>> r.tokens, r.num_accepted, r.last_kind
    ([0, 1], 1, 'recovered')

Point-mass drafts (greedy or n-gram drafters) pass ``draft_probs=None``: q_i is one-hot on x_i, so
acceptance is u_i < p_i(x_i) and the residual is p_i with x_i removed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from verispec.sampling import sample_batch

LastKind = Literal["recovered", "bonus"]


@dataclass(frozen=True)
class ChainResult:
    """tokens: accepted drafts, then one recovered or bonus token (len == num_accepted + 1)."""

    tokens: list[int]
    num_accepted: int
    last_kind: LastKind

    @property
    def recovered_token(self) -> int | None:
        return self.tokens[-1] if self.last_kind == "recovered" else None

    @property
    def bonus_token(self) -> int | None:
        return self.tokens[-1] if self.last_kind == "bonus" else None


def verify_chain(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
                 uniforms: torch.Tensor | None = None, final_uniform: float | None = None,
                 generator: torch.Generator | None = None) -> ChainResult:
    """Verify one sequence's K drafts.

    draft_tokens: (K,) int. draft_probs: (K, V) or None for point masses. target_probs: (K+1, V).
    uniforms: (K,) in [0, 1) and final_uniform in [0, 1); drawn from ``generator`` when omitted.
    """
    num_drafts = draft_tokens.shape[0]
    assert target_probs.dim() == 2 and target_probs.shape[0] == num_drafts + 1, target_probs.shape
    assert draft_probs is None or draft_probs.shape == (num_drafts, target_probs.shape[1]), draft_probs
    if uniforms is None:
        uniforms = torch.rand(num_drafts, generator=generator, dtype=torch.float64)
    if final_uniform is None:
        final_uniform = torch.rand((), generator=generator, dtype=torch.float64).item()
    accepted, tokens, kinds = verify_chain_batch(
        draft_tokens[None], None if draft_probs is None else draft_probs[None], target_probs[None],
        torch.as_tensor(uniforms, dtype=torch.float64)[None],
        torch.tensor([float(final_uniform)], dtype=torch.float64))  # float64: exact replay of the draw
    num_accepted = int(accepted[0])
    return ChainResult(tokens[0, :num_accepted + 1].tolist(), num_accepted,
                       "bonus" if kinds[0] else "recovered")


def verify_chain_greedy(draft_tokens: list[int], target_argmax: list[int]) -> ChainResult:
    """Greedy fast path: with one-hot p (temperature 0) and point-mass drafts, draft i is accepted iff
    it equals the target's argmax at its position, and the recovered / bonus token is that argmax.
    Identical to ``verify_chain`` on one-hot inputs (tested), without probabilities or uniforms.

    draft_tokens: K ids; target_argmax: K+1 ids (argmax of each verified position's logits).
    """
    assert len(target_argmax) == len(draft_tokens) + 1
    num_accepted = 0
    while num_accepted < len(draft_tokens) and draft_tokens[num_accepted] == target_argmax[num_accepted]:
        num_accepted += 1
    kind = "bonus" if num_accepted == len(draft_tokens) else "recovered"
    return ChainResult(list(draft_tokens[:num_accepted]) + [target_argmax[num_accepted]], num_accepted, kind)


def verify_chain_batch(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                       target_probs: torch.Tensor, uniforms: torch.Tensor, final_uniforms: torch.Tensor,
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Vectorised chain verification for B sequences.

    draft_tokens (B, K); draft_probs (B, K, V) or None; target_probs (B, K+1, V); uniforms (B, K);
    final_uniforms (B,). Returns num_accepted (B,), emitted (B, K+1) with -1 after the last emitted
    token, and is_bonus (B,) bool.
    """
    batch, num_drafts = draft_tokens.shape
    assert target_probs.shape[:2] == (batch, num_drafts + 1), target_probs.shape
    device = target_probs.device  # everything runs where the target's probabilities are (CPU or CUDA)
    draft_tokens, uniforms = draft_tokens.to(device), uniforms.to(device)
    draft_probs = None if draft_probs is None else draft_probs.to(device)
    rows = torch.arange(batch, device=device)[:, None]
    steps = torch.arange(num_drafts, device=device)[None, :]
    target_at_draft = target_probs[rows, steps, draft_tokens].double()  # (B, K): p_i(x_i)
    if draft_probs is None:
        draft_at_draft = torch.ones_like(target_at_draft)
    else:
        draft_at_draft = draft_probs[rows, steps, draft_tokens].double()  # (B, K): q_i(x_i)
    # u < min(1, p/q)  <=>  u * q < p  for q > 0 and u < 1; no division, so p == q never rejects.
    accept = uniforms.double() * draft_at_draft < target_at_draft
    num_accepted = accept.long().cumprod(-1).sum(-1)  # (B,)
    is_bonus = num_accepted == num_drafts

    stop = num_accepted.clamp(max=num_drafts - 1) if num_drafts else num_accepted
    at_stop = target_probs[rows[:, 0], stop].double()  # (B, V): p at the first rejection
    if num_drafts == 0:  # nothing to reject (draft_probs may be (B, 0, V)): the round is a bonus from p_1
        draft_at_stop = torch.zeros_like(at_stop)
    elif draft_probs is None:
        draft_at_stop = torch.nn.functional.one_hot(draft_tokens[rows[:, 0], stop],
                                                    target_probs.shape[-1]).double()
    else:
        draft_at_stop = draft_probs[rows[:, 0], stop].double()
    residual = (at_stop - draft_at_stop).clamp(min=0)
    # A rejection needs p(x) < q(x), hence some y with p(y) > q(y): the residual has mass. Only
    # float noise can empty it, and then p == q up to rounding, so p itself is the right fallback.
    empty = residual.sum(-1, keepdim=True) <= 0
    residual = torch.where(empty, at_stop, residual)
    bonus_probs = target_probs[:, num_drafts].double()
    last_probs = torch.where(is_bonus[:, None], bonus_probs, residual)
    last_token = sample_batch(last_probs, final_uniforms)

    emitted = torch.where(steps < num_accepted[:, None], draft_tokens, torch.full_like(draft_tokens, -1))
    emitted = torch.cat([emitted, torch.full((batch, 1), -1, dtype=draft_tokens.dtype, device=device)], dim=1)
    emitted[rows[:, 0], num_accepted] = last_token
    return num_accepted, emitted, is_bonus
