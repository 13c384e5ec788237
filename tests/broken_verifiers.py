"""Deliberately wrong verifiers, shared by the tests that must catch them (they prove the tests have teeth)."""

from __future__ import annotations

import torch

from verispec.sampling import sample_batch
from verispec.verify.chain import ChainResult, verify_chain


def resample_from_target_after_rejection(draft_tokens, draft_probs, target_probs, generator=None, **_):
    """Known-wrong: on rejection draw from p instead of norm(max(0, p - q))."""
    correct = verify_chain(draft_tokens=draft_tokens, draft_probs=draft_probs, target_probs=target_probs,
                           generator=generator)
    if correct.last_kind == "bonus":
        return correct
    at = correct.num_accepted
    token = int(sample_batch(target_probs[at][None], torch.rand(1, generator=generator, dtype=torch.float64))[0])
    return ChainResult(correct.tokens[:-1] + [token], at, "recovered")
