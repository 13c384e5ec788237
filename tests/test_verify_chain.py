"""verify/chain.py: the float chain verifier agrees with the exact Fraction oracle, draw for draw.

Every case is replayed with explicit uniforms through ``verify_chain`` (float) and
``verify_chain_exact`` (Fractions of the very same float values), and the results must be identical.
Floats and Fractions can only disagree when a uniform sits on a threshold (an acceptance ratio
p_i(x_i) / q_i(x_i) or a CDF boundary of the recovered/bonus distribution) up to rounding, so cases
with a uniform within 1e-9 of one are redrawn (random cases) or discarded (hypothesis).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from fractions import Fraction as F

import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from verispec.verify.chain import ChainResult, verify_chain, verify_chain_batch
from verispec.verify.exact import one_hot, residual_exact, verify_chain_exact

TIE_MARGIN = 1e-9
LARGEST_BELOW_ONE = math.nextafter(1.0, 0.0)


@dataclass
class ChainCase:
    draft_tokens: list[int]
    draft_probs: torch.Tensor | None  # (K, V) float32, or None for point-mass drafts
    target_probs: torch.Tensor  # (K+1, V) float32
    uniforms: list[float]  # (K,)
    final_uniform: float

    def run_float(self) -> ChainResult:
        return verify_chain(torch.tensor(self.draft_tokens, dtype=torch.long), self.draft_probs,
                            self.target_probs, torch.tensor(self.uniforms, dtype=torch.float64),
                            self.final_uniform)

    def run_exact(self) -> ChainResult:
        draft = None if self.draft_probs is None else to_fractions(self.draft_probs)
        return verify_chain_exact(self.draft_tokens, draft, to_fractions(self.target_probs),
                                  [F(u) for u in self.uniforms], F(self.final_uniform))

    def exact_draft_dist(self, i: int) -> list[F]:
        vocab = self.target_probs.shape[1]
        if self.draft_probs is None:
            return one_hot(self.draft_tokens[i], vocab)
        return to_fractions(self.draft_probs[i])

    def near_a_tie(self) -> bool:
        """Does a uniform lie within TIE_MARGIN of a threshold the exact replay compares it with?"""
        target = to_fractions(self.target_probs)
        for i, token in enumerate(self.draft_tokens):
            threshold = min(F(1), target[i][token] / self.exact_draft_dist(i)[token])
            if 0 < threshold < 1 and abs(self.uniforms[i] - threshold) < TIE_MARGIN:
                return True
        result = self.run_exact()
        i = result.num_accepted
        last = target[i] if result.last_kind == "bonus" else residual_exact(target[i], self.exact_draft_dist(i))
        total, cumulative = sum(last, F(0)), F(0)
        for mass in last[:-1]:
            cumulative += mass
            if 0 < cumulative < total and abs(self.final_uniform - cumulative / total) < TIE_MARGIN:
                return True
        return False


def to_fractions(probs: torch.Tensor) -> list:
    """Exact Fractions of the float values (nested like the tensor)."""
    return [[F(x) for x in row] for row in probs.tolist()] if probs.dim() == 2 else [F(x) for x in probs.tolist()]


def assert_invariants(case: ChainCase, result: ChainResult) -> None:
    num_drafts = len(case.draft_tokens)
    assert len(result.tokens) == result.num_accepted + 1
    assert 0 <= result.num_accepted <= num_drafts
    assert result.tokens[:result.num_accepted] == case.draft_tokens[:result.num_accepted]
    i, last = result.num_accepted, result.tokens[-1]
    if result.last_kind == "bonus":
        assert result.num_accepted == num_drafts and result.bonus_token == last
        assert case.target_probs[num_drafts, last] > 0
    else:
        assert result.num_accepted < num_drafts and result.recovered_token == last
        p = case.target_probs[i].double()
        q = case.draft_probs[i].double() if case.draft_probs is not None else torch.zeros_like(p).index_fill_(
            0, torch.tensor(case.draft_tokens[i]), 1.0)
        # Only float noise can reject with an empty residual (p <= q everywhere); then p is the fallback.
        if (p > q).any():
            assert p[last] > q[last]
        else:
            assert p[last] > 0


# --- random cases ------------------------------------------------------------------------------------

def random_distribution(rng: random.Random, vocab: int) -> list[float]:
    weights = [0.0 if rng.random() < 0.3 else rng.random() for _ in range(vocab)]
    if not any(weights):
        weights[rng.randrange(vocab)] = 1.0
    return [w / sum(weights) for w in weights]


def random_case(rng: random.Random, draft_kind: str) -> ChainCase:
    """draft_kind: 'random' (independent q), 'equal' (q = p), 'point_mass' (draft_probs None)."""
    vocab, num_drafts = rng.randint(2, 6), rng.randint(0, 5)
    target = torch.tensor([random_distribution(rng, vocab) for _ in range(num_drafts + 1)])
    if draft_kind == "random":
        draft = torch.tensor([random_distribution(rng, vocab) for _ in range(num_drafts)]).reshape(num_drafts, vocab)
    elif draft_kind == "equal":
        draft = target[:num_drafts].clone()
    else:
        draft = None
    tokens = []
    for i in range(num_drafts):
        support_from = target[i] if draft is None else draft[i]  # a point-mass draft may still miss p
        support = [t for t in range(vocab) if support_from[t] > 0 or (draft is None and rng.random() < 0.2)]
        tokens.append(rng.choice(support))
    uniforms = [rng.random() for _ in range(num_drafts)]
    return ChainCase(tokens, draft, target, uniforms, rng.random())


def random_cases_away_from_ties(seed: int, count: int, draft_kind: str) -> list[ChainCase]:
    rng = random.Random(seed)
    cases = []
    while len(cases) < count:
        case = random_case(rng, draft_kind)
        if not case.near_a_tie():
            cases.append(case)
    return cases


def test_worked_example_round_replays_to_a_then_b():
    # docs/algorithms.md's worked example: p = (0.5, 0.3, 0.2), q = (0.6, 0.1, 0.3); drafts A, C, B;
    # draws 0.7, 0.9, 0.2; final 0.2.
    p, q = torch.tensor([[0.5, 0.3, 0.2]] * 4), torch.tensor([[0.6, 0.1, 0.3]] * 3)
    result = verify_chain(torch.tensor([0, 2, 1]), q, p, torch.tensor([0.7, 0.9, 0.2]), 0.2)
    assert (result.tokens, result.num_accepted, result.last_kind) == ([0, 1], 1, "recovered")
    assert result.recovered_token == 1 and result.bonus_token is None


def test_worked_example_round_accepts_everything_with_small_draws():
    p, q = torch.tensor([[0.5, 0.3, 0.2]] * 4), torch.tensor([[0.6, 0.1, 0.3]] * 3)
    result = verify_chain(torch.tensor([0, 2, 1]), q, p, torch.tensor([0.1, 0.1, 0.1]), 0.9)
    assert (result.tokens, result.num_accepted, result.last_kind) == ([0, 2, 1, 2], 3, "bonus")
    assert result.bonus_token == 2


def test_equal_draft_and_target_never_reject():
    rng = random.Random(5)
    uniforms = [0.0, 0.3, 0.5, 0.9, 1 - 1e-12, LARGEST_BELOW_ONE]
    for _ in range(50):
        case = random_case(rng, "equal")
        for u in uniforms:
            case.uniforms = [u] * len(case.draft_tokens)
            result = case.run_float()
            assert result.num_accepted == len(case.draft_tokens) and result.last_kind == "bonus", (case, u)


def test_point_mass_draft_with_full_target_mass_is_always_accepted():
    target = torch.tensor([[0.0, 1.0, 0.0], [0.2, 0.3, 0.5]])
    result = verify_chain(torch.tensor([1]), None, target, torch.tensor([LARGEST_BELOW_ONE], dtype=torch.float64), 0.25)
    assert (result.tokens, result.last_kind) == ([1, 1], "bonus")


def test_point_mass_rejection_recovers_from_target_without_the_draft():
    # p = (0.2, 0.3, 0.5), draft 2 rejected (u = 0.6 >= 0.5): residual (0.4, 0.6, 0).
    target = torch.tensor([[0.2, 0.3, 0.5], [1.0, 0.0, 0.0]])
    for final_uniform, expected in [(0.0, 0), (0.39, 0), (0.41, 1), (LARGEST_BELOW_ONE, 1)]:
        result = verify_chain(torch.tensor([2]), None, target, torch.tensor([0.6]), final_uniform)
        assert (result.tokens, result.last_kind) == ([expected], "recovered")


def test_no_drafts_is_a_bonus_from_the_first_target_row():
    target = torch.tensor([[0.0, 0.25, 0.75]])
    no_drafts = torch.tensor([], dtype=torch.long)
    for draft_probs in (None, torch.empty(0, 3)):  # (K, V) with K = 0 is a valid draft_probs
        result = verify_chain(no_drafts, draft_probs, target, torch.tensor([]), 0.2)
        assert (result.tokens, result.num_accepted, result.last_kind) == ([1], 0, "bonus")


def test_final_uniform_is_used_at_double_precision():
    target = torch.tensor([[0.5, 0.25, 0.25]])  # K = 0: the bonus comes straight from p_1
    no_drafts = torch.tensor([], dtype=torch.long)
    assert verify_chain(no_drafts, None, target, torch.tensor([]), 0.5 - 2 ** -40).tokens == [0]
    assert verify_chain(no_drafts, None, target, torch.tensor([]), 0.5).tokens == [1]


def test_float_matches_exact_on_random_cases():
    for draft_kind, seed in [("random", 10), ("equal", 11), ("point_mass", 12)]:
        for case in random_cases_away_from_ties(seed, 150, draft_kind):
            result = case.run_float()
            assert result == case.run_exact(), case
            assert_invariants(case, result)


def test_one_hot_draft_probs_equal_point_mass_mode():
    for case in random_cases_away_from_ties(13, 100, "point_mass"):
        vocab = case.target_probs.shape[1]
        one_hots = torch.nn.functional.one_hot(torch.tensor(case.draft_tokens, dtype=torch.long), vocab).float()
        explicit = ChainCase(case.draft_tokens, one_hots, case.target_probs, case.uniforms, case.final_uniform)
        assert explicit.run_float() == case.run_float(), case


def test_generator_draws_are_reproducible():
    case = random_case(random.Random(14), "random")
    results = [verify_chain(torch.tensor(case.draft_tokens, dtype=torch.long), case.draft_probs, case.target_probs,
                            generator=torch.Generator().manual_seed(7)) for _ in range(3)]
    assert results[0] == results[1] == results[2]


# --- batch form --------------------------------------------------------------------------------------

def random_batch(seed: int, batch: int, vocab: int, num_drafts: int, point_mass: bool):
    generator = torch.Generator().manual_seed(seed)
    target = torch.rand(batch, num_drafts + 1, vocab, generator=generator)
    target[target < 0.25] = 0
    target[..., 0] += 1e-3
    target /= target.sum(-1, keepdim=True)
    draft = torch.rand(batch, num_drafts, vocab, generator=generator)
    draft[draft < 0.25] = 0
    draft[..., -1] += 1e-3
    draft /= draft.sum(-1, keepdim=True)
    tokens = torch.multinomial(draft.reshape(-1, vocab), 1, generator=generator).reshape(batch, num_drafts)
    uniforms = torch.rand(batch, num_drafts, generator=generator, dtype=torch.float64)
    final_uniforms = torch.rand(batch, generator=generator, dtype=torch.float64)
    return tokens, None if point_mass else draft, target, uniforms, final_uniforms


def test_batch_equals_single_form_row_by_row():
    kinds_seen = set()
    for seed, (vocab, num_drafts, point_mass) in enumerate([(5, 4, False), (3, 1, False), (6, 0, False),
                                                            (4, 3, True), (2, 5, True)]):
        tokens, draft, target, uniforms, final_uniforms = random_batch(seed, 64, vocab, num_drafts, point_mass)
        num_accepted, emitted, is_bonus = verify_chain_batch(tokens, draft, target, uniforms, final_uniforms)
        assert emitted.shape == (64, num_drafts + 1)
        for b in range(64):
            single = verify_chain(tokens[b], None if draft is None else draft[b], target[b], uniforms[b],
                                  float(final_uniforms[b]))
            assert int(num_accepted[b]) == single.num_accepted
            assert bool(is_bonus[b]) == (single.last_kind == "bonus")
            assert emitted[b, :single.num_accepted + 1].tolist() == single.tokens
            assert (emitted[b, single.num_accepted + 1:] == -1).all()
        kinds_seen.update(is_bonus.tolist())
    assert kinds_seen == {True, False}  # both bonus and recovered rows were compared


# --- hypothesis --------------------------------------------------------------------------------------

@st.composite
def chain_cases(draw) -> ChainCase:
    vocab = draw(st.integers(2, 6))
    num_drafts = draw(st.integers(0, 5))
    weight = st.one_of(st.just(0.0), st.floats(1e-4, 1.0))

    def distribution() -> list[float]:
        weights = draw(st.lists(weight, min_size=vocab, max_size=vocab).filter(any))
        return [w / sum(weights) for w in weights]

    target = torch.tensor([distribution() for _ in range(num_drafts + 1)])
    draft_kind = draw(st.sampled_from(["random", "equal", "point_mass"]))
    if draft_kind == "random":
        draft = torch.tensor([distribution() for _ in range(num_drafts)]).reshape(num_drafts, vocab)
    elif draft_kind == "equal":
        draft = target[:num_drafts].clone()
    else:
        draft = None
    tokens = []
    for i in range(num_drafts):
        support = range(vocab) if draft is None else [t for t in range(vocab) if draft[i, t] > 0]
        tokens.append(draw(st.sampled_from(list(support))))
    uniform = st.floats(0.0, 1.0, exclude_max=True)
    uniforms = [draw(uniform) for _ in range(num_drafts)]
    return ChainCase(tokens, draft, target, uniforms, draw(uniform))


@settings(max_examples=200, deadline=None)
@given(case=chain_cases())
def test_float_matches_exact_on_arbitrary_cases(case):
    assume(not case.near_a_tie())
    result = case.run_float()
    assert result == case.run_exact()
    assert_invariants(case, result)
