"""Statistical losslessness of the float chain verifier: simulated rounds converge to the target.

Toy setting (as in docs/algorithms.md's worked example, but with a distribution per position): target p
and draft q depend only on the absolute position, not on the tokens before it, so the target's own
output is independent tokens y_1, y_2, ... with y_j ~ p_j. Each test simulates N rounds at once with
``verify_chain_batch`` (drafts drawn from q with a seeded torch.Generator) and checks two things:

(a) the first emitted token of a round starting at position 1 follows p_1;
(b) the pair (y_1, y_2) follows p_1 x p_2, where y_2 is the round's second emitted token when the round
    emitted at least two, and otherwise the first token of the next round, which starts at position 2
    (drafting from q_2.., verified against p_2..). (b) also sees what comes after an accept: an accepted
    draft followed by a wrongly placed bonus passes (a) and fails (b).

A sample passes when the chi-square p-value exceeds 1e-4 and the total variation from the expected
distribution is below 3 sqrt(C / N) for C cells (see stats_helpers: a correct sampler fails this with
probability < 1e-4 + 1e-10). Every seed is fixed, so the outcome is deterministic. Two deliberately broken
verifiers must fail: one that resamples from p after a rejection (docs/algorithms.md, Chain
verification), and one that draws the bonus token from p_K instead of p_{K+1}.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

from stats_helpers import FitResult, describe, fit_to_distribution
from verispec.config import SamplingParams
from verispec.sampling import logits_to_probs, sample_batch
from verispec.verify.chain import verify_chain_batch

NUM_ROUNDS = 40_000
NUM_DRAFTS = 3


@dataclass(frozen=True)
class PositionalPair:
    """Target and draft whose distributions depend on the absolute position only (0-based rows)."""

    target_probs: torch.Tensor  # (P+1, V)
    draft_probs: torch.Tensor | None  # (P, V); None: point-mass drafts of point_tokens
    point_tokens: torch.Tensor | None = None  # (P,)

    @property
    def vocab(self) -> int:
        return self.target_probs.shape[1]


# --- the pairs under test ----------------------------------------------------------------------------

def random_probs(generator: torch.Generator, rows: int, vocab: int) -> torch.Tensor:
    """Random distributions with about a quarter of the entries zero (never a whole row)."""
    probs = torch.rand(rows, vocab, generator=generator)
    probs[torch.rand(rows, vocab, generator=generator) < 0.25] = 0
    probs[torch.arange(rows), torch.randint(vocab, (rows,), generator=generator)] += 0.05
    return probs / probs.sum(-1, keepdim=True)


def make_pair(kind: str, seed: int) -> PositionalPair:
    generator = torch.Generator().manual_seed(seed)
    vocab = 4 + seed % 2
    positions = NUM_DRAFTS + 1  # rounds start at position 1 or 2 and verify NUM_DRAFTS drafts
    target = random_probs(generator, positions + 1, vocab)
    if kind == "random":
        return PositionalPair(target, random_probs(generator, positions, vocab))
    if kind == "equal":
        return PositionalPair(target, target[:positions].clone())
    # Point-mass drafts are one fixed token per position, drawn once from p so that they are often accepted.
    fixed_tokens = torch.multinomial(target[:positions], 1, generator=generator)[:, 0]
    if kind == "one_hot_probs":
        return PositionalPair(target, torch.nn.functional.one_hot(fixed_tokens, vocab).float())
    if kind == "point_mass":
        return PositionalPair(target, None, fixed_tokens)
    params = {"temperature": SamplingParams(temperature=0.7), "top_k": SamplingParams(top_k=2),
              "top_p": SamplingParams(top_p=0.8), "min_p": SamplingParams(min_p=0.2)}[kind]
    target_logits = torch.randn(positions + 1, vocab, generator=generator) * 1.5
    # A draft resembles its target: its logits are the target's plus noise, so both branches get weight.
    draft_logits = target_logits[:positions] + torch.randn(positions, vocab, generator=generator)
    return PositionalPair(logits_to_probs(target_logits, params), logits_to_probs(draft_logits, params))


PAIR_KINDS = ["random", "equal", "one_hot_probs", "point_mass", "temperature", "top_k", "top_p", "min_p"]


# --- simulation --------------------------------------------------------------------------------------

def simulate_rounds(pair: PositionalPair, start: int, num_drafts: int, generator: torch.Generator,
                    verifier=verify_chain_batch) -> tuple[torch.Tensor, torch.Tensor]:
    """NUM_ROUNDS independent rounds starting at 0-based position ``start``: (num_accepted, emitted)."""
    n, vocab = NUM_ROUNDS, pair.vocab
    steps = range(start, start + num_drafts)
    if pair.draft_probs is None:
        drafts = pair.point_tokens[start:start + num_drafts].expand(n, num_drafts)
        draft_probs = None
    else:
        drafts = torch.stack([torch.multinomial(pair.draft_probs[i], n, replacement=True, generator=generator)
                              for i in steps], dim=1)  # (N, K)
        draft_probs = pair.draft_probs[start:start + num_drafts].expand(n, num_drafts, vocab)
    target_probs = pair.target_probs[start:start + num_drafts + 1].expand(n, num_drafts + 1, vocab)
    uniforms = torch.rand(n, num_drafts, generator=generator, dtype=torch.float64)
    final_uniforms = torch.rand(n, generator=generator, dtype=torch.float64)
    num_accepted, emitted, _ = verifier(drafts, draft_probs, target_probs, uniforms, final_uniforms)
    return num_accepted, emitted


def first_token_fit(pair: PositionalPair, seed: int, num_drafts: int = NUM_DRAFTS,
                    verifier=verify_chain_batch) -> FitResult:
    generator = torch.Generator().manual_seed(seed)
    _, emitted = simulate_rounds(pair, 0, num_drafts, generator, verifier)
    return fit_to_distribution(emitted[:, 0].numpy(), pair.target_probs[0].double().numpy())


def token_pair_fit(pair: PositionalPair, seed: int, num_drafts: int = NUM_DRAFTS,
                   verifier=verify_chain_batch) -> FitResult:
    generator = torch.Generator().manual_seed(seed)
    num_accepted, emitted = simulate_rounds(pair, 0, num_drafts, generator, verifier)
    _, next_round = simulate_rounds(pair, 1, num_drafts, generator, verifier)
    first = emitted[:, 0]
    second = torch.where(num_accepted >= 1, emitted[:, 1], next_round[:, 0])
    p1, p2 = pair.target_probs[0].double().numpy(), pair.target_probs[1].double().numpy()
    return fit_to_distribution((first * pair.vocab + second).numpy(), np.outer(p1, p2).ravel())


# --- deliberately broken verifiers -------------------------------------------------------------------

def verifier_resampling_from_p(drafts, draft_probs, target_probs, uniforms, final_uniforms):
    """BROKEN: after a rejection, draw from p_i itself instead of norm(max(0, p_i - q_i))."""
    num_accepted, emitted, is_bonus = verify_chain_batch(drafts, draft_probs, target_probs, uniforms,
                                                         final_uniforms)
    rows = torch.arange(len(drafts))
    resampled = sample_batch(target_probs[rows, num_accepted], final_uniforms)
    emitted[rows, num_accepted] = torch.where(is_bonus, emitted[rows, num_accepted], resampled)
    return num_accepted, emitted, is_bonus


def verifier_with_bonus_one_position_early(drafts, draft_probs, target_probs, uniforms, final_uniforms):
    """BROKEN: the bonus after K accepted drafts comes from p_K instead of p_{K+1} (an offset slip)."""
    num_accepted, emitted, is_bonus = verify_chain_batch(drafts, draft_probs, target_probs, uniforms,
                                                         final_uniforms)
    rows, num_drafts = torch.arange(len(drafts)), drafts.shape[1]
    early_bonus = sample_batch(target_probs[:, num_drafts - 1], final_uniforms)
    emitted[rows, num_accepted] = torch.where(is_bonus, early_bonus, emitted[rows, num_accepted])
    return num_accepted, emitted, is_bonus


# --- tests -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", PAIR_KINDS)
def test_first_emitted_token_follows_target(kind):
    pair = make_pair(kind, seed=PAIR_KINDS.index(kind))
    result = first_token_fit(pair, seed=100 + PAIR_KINDS.index(kind))
    assert result.passes, describe(result)


@pytest.mark.parametrize("kind", PAIR_KINDS)
def test_token_pair_follows_product_of_targets(kind):
    pair = make_pair(kind, seed=PAIR_KINDS.index(kind))
    result = token_pair_fit(pair, seed=200 + PAIR_KINDS.index(kind))
    assert result.passes, describe(result)


@pytest.mark.parametrize("kind", PAIR_KINDS)
def test_pairs_exercise_both_the_recovered_and_the_bonus_branch(kind):
    # Guards the tests above against vacuity: unless q == p, both kinds of last token carry real weight.
    pair = make_pair(kind, seed=PAIR_KINDS.index(kind))
    num_accepted, _ = simulate_rounds(pair, 0, NUM_DRAFTS, torch.Generator().manual_seed(1))
    bonus_share = (num_accepted == NUM_DRAFTS).double().mean().item()
    assert bonus_share == 1.0 if kind == "equal" else 0.03 < bonus_share < 0.97


def hand_pair() -> PositionalPair:
    """p and q far apart, same at every position: resampling from p shifts p_1 by TV 0.15."""
    target = torch.tensor([[0.5, 0.3, 0.2, 0.0]] * (NUM_DRAFTS + 2))
    draft = torch.tensor([[0.6, 0.1, 0.1, 0.2]] * (NUM_DRAFTS + 1))
    return PositionalPair(target, draft)


def test_resampling_from_p_fails_both_checks():
    for pair in [hand_pair(), make_pair("random", seed=0), make_pair("top_p", seed=6)]:
        for fit in (first_token_fit(pair, seed=300, verifier=verifier_resampling_from_p),
                    token_pair_fit(pair, seed=301, verifier=verifier_resampling_from_p)):
            assert not fit.passes, describe(fit)
    hand = first_token_fit(hand_pair(), seed=302, verifier=verifier_resampling_from_p)
    assert hand.pvalue < 1e-10 and hand.total_variation > hand.tv_bound, describe(hand)


def test_early_bonus_passes_the_first_token_check_but_fails_the_pair_check():
    # One draft per round, so the bonus is the second token: y_2 comes from p_1 instead of p_2.
    target = torch.tensor([[0.7, 0.1, 0.1, 0.1], [0.1, 0.1, 0.1, 0.7], [0.25] * 4])
    pair = PositionalPair(target, torch.full((2, 4), 0.25))
    first = first_token_fit(pair, seed=400, num_drafts=1, verifier=verifier_with_bonus_one_position_early)
    assert first.passes, describe(first)
    joint = token_pair_fit(pair, seed=401, num_drafts=1, verifier=verifier_with_bonus_one_position_early)
    assert joint.pvalue < 1e-10 and joint.total_variation > joint.tv_bound, describe(joint)
    correct = token_pair_fit(pair, seed=401, num_drafts=1)
    assert correct.passes, describe(correct)
