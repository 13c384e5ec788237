"""verify/exact.py: the worked example's numbers (docs/algorithms.md, Chain verification), and exact
end-to-end losslessness on a toy language model.

Everything here is Fraction arithmetic, so equalities are exact. The end-to-end check enumerates every
outcome of repeated chain rounds on a 3-token toy model and requires the distribution of the first
``length`` tokens to equal the target's own, to the last digit. A variant that resamples from p after a
rejection (the mistake docs/algorithms.md warns about) must give a different distribution, so the check has teeth.
"""

from __future__ import annotations

import random
from fractions import Fraction as F

import pytest

from verispec.verify.exact import (ToyModel, acceptance_masses, chain_round_outcomes, one_hot, residual_exact,
                                   sample_exact, spec_sequence_distribution, target_sequence_distribution,
                                   verify_chain_exact)

EXAMPLE_P = [F("0.5"), F("0.3"), F("0.2")]  # A, B, C = 0, 1, 2
EXAMPLE_Q = [F("0.6"), F("0.1"), F("0.3")]


def toy_model(seed: int, vocab: int = 3) -> ToyModel:
    """A deterministic prefix -> distribution map: small integer weights (some zero) from a keyed RNG."""
    def next_token_distribution(prefix: tuple[int, ...]) -> list[F]:
        rng = random.Random(f"{seed}:{prefix}")
        weights = [rng.choice([0, 1, 2, 3, 5]) for _ in range(vocab)]
        if not any(weights):
            weights[rng.randrange(vocab)] = 1
        return [F(w, sum(weights)) for w in weights]
    return next_token_distribution


def repeated_rounds_distribution(round_outcomes, length: int) -> dict[tuple[int, ...], F]:
    """Distribution of the first ``length`` tokens from rounds ``round_outcomes(prefix) -> {tokens: mass}``."""
    result: dict[tuple[int, ...], F] = {}
    pending = [((), F(1))]
    while pending:
        emitted, mass = pending.pop()
        if len(emitted) >= length:
            result[emitted[:length]] = result.get(emitted[:length], F(0)) + mass
            continue
        pending.extend((emitted + tokens, mass * weight) for tokens, weight in round_outcomes(emitted).items())
    return result


def round_resampling_from_p(prefix, target: ToyModel, draft: ToyModel, gamma: int) -> dict[tuple[int, ...], F]:
    """A BROKEN chain round: like chain_round_outcomes, but a rejection resamples from p, not the residual."""
    outcomes: dict[tuple[int, ...], F] = {}

    def walk(emitted: tuple[int, ...], mass: F) -> None:
        p = target(prefix + emitted)
        if len(emitted) == gamma:
            for token, pt in enumerate(p):
                outcomes[emitted + (token,)] = outcomes.get(emitted + (token,), F(0)) + mass * pt
            return
        q = draft(prefix + emitted)
        for token, qt in enumerate(q):
            if qt:
                accept = min(F(1), p[token] / qt)
                walk(emitted + (token,), mass * qt * accept)
                for resampled, pt in enumerate(p):  # the mistake: p instead of residual_exact(p, q)
                    key = emitted + (resampled,)
                    outcomes[key] = outcomes.get(key, F(0)) + mass * qt * (1 - accept) * pt

    walk((), F(1))
    return {tokens: mass for tokens, mass in outcomes.items() if mass}


# --- the worked example (docs/algorithms.md) ---------------------------------------------------------

def test_example_accounting_of_probability_mass():
    masses = acceptance_masses(EXAMPLE_P, EXAMPLE_Q)
    assert masses.accepted == [F("0.5"), F("0.1"), F("0.2")]
    assert masses.acceptance == F("0.8")
    assert masses.residual == [0, 1, 0]
    assert masses.reconstructed == EXAMPLE_P
    # The acceptance probabilities min(1, p/q) are 5/6, 1, 2/3.
    assert [min(F(1), p / q) for p, q in zip(EXAMPLE_P, EXAMPLE_Q)] == [F(5, 6), F(1), F(2, 3)]


def test_example_round_replays_exactly():
    result = verify_chain_exact([0, 2, 1], [EXAMPLE_Q] * 3, [EXAMPLE_P] * 4, [F("0.7"), F("0.9"), F("0.2")], F("0.2"))
    assert (result.tokens, result.num_accepted, result.last_kind) == ([0, 1], 1, "recovered")
    assert result.recovered_token == 1  # B replaces the rejected C; the draft B after it is discarded


def test_example_round_with_all_drafts_accepted_ends_with_a_bonus():
    result = verify_chain_exact([0, 2, 1], [EXAMPLE_Q] * 3, [EXAMPLE_P] * 4, [F("0.1")] * 3, F("0.2"))
    assert (result.tokens, result.last_kind) == ([0, 2, 1, 0], "bonus")


def test_equal_distributions_never_reject():
    masses = acceptance_masses(EXAMPLE_P, EXAMPLE_P)
    assert masses.acceptance == 1 and masses.residual is None and masses.reconstructed == EXAMPLE_P
    for u in [F(0), F(1, 3), F("0.5"), F("0.999"), 1 - F(1, 10 ** 30)]:
        result = verify_chain_exact([0, 2, 1], [EXAMPLE_P] * 3, [EXAMPLE_P] * 4, [u] * 3, F(0))
        assert result.num_accepted == 3 and result.last_kind == "bonus"


@pytest.mark.parametrize("p, q", [(EXAMPLE_P, EXAMPLE_Q), (EXAMPLE_Q, EXAMPLE_P), ([F(1), F(0), F(0)], [F(1, 3)] * 3),
                                  ([F(0), F(1, 2), F(1, 2)], [F(1, 2), F(1, 2), F(0)])])
def test_accepted_plus_residual_restores_p(p, q):
    masses = acceptance_masses(p, q)
    assert masses.acceptance == sum(min(a, b) for a, b in zip(p, q)) < 1
    assert sum(masses.residual) == 1 and masses.reconstructed == p


def test_sample_exact_is_the_inverse_cdf():
    assert [sample_exact(EXAMPLE_P, F(u)) for u in ["0", "0.49", "0.5", "0.79", "0.8", "0.99"]] == [0, 0, 1, 1, 2, 2]
    assert sample_exact([F(0), F(2), F(0), F(6)], F("0.25")) == 3  # unnormalised: scaled by the total
    assert residual_exact([F(0), F(1)], [F(0), F(1)]) == [F(0), F(1)]  # empty residual falls back to p


def test_round_outcomes_sum_to_one_and_match_the_example_first_token():
    constant_p, constant_q = (lambda prefix: EXAMPLE_P), (lambda prefix: EXAMPLE_Q)
    outcomes = chain_round_outcomes((), constant_p, constant_q, gamma=2)
    assert sum(outcomes.values()) == 1
    first_token = [sum(m for tokens, m in outcomes.items() if tokens[0] == t) for t in range(3)]
    assert first_token == EXAMPLE_P
    assert all(1 <= len(tokens) <= 3 for tokens in outcomes)


def test_greedy_draft_proposes_the_lowest_id_among_tied_maxima():
    # q ties tokens 0 and 1, so the greedy draft is token 0: accepted with p(0) = 1/2, else the residual
    # of p without token 0 gives B (0.3) or C (0.2).
    tied_draft = [F(1, 2), F(1, 2), F(0)]
    outcomes = chain_round_outcomes((), lambda prefix: EXAMPLE_P, lambda prefix: tied_draft, gamma=1, greedy_draft=True)
    expected = {(0, token): F(1, 2) * p for token, p in enumerate(EXAMPLE_P)} | {(1,): F("0.3"), (2,): F("0.2")}
    assert outcomes == expected


# --- end-to-end losslessness on a toy model ----------------------------------------------------------

TARGET, DRAFT = toy_model(seed=1), toy_model(seed=2)


def test_toy_models_have_zeros_and_differ():
    prefixes = [(), (0,), (1,), (2,), (0, 1), (2, 2)]
    assert any(0 in TARGET(prefix) for prefix in prefixes) and any(0 in DRAFT(prefix) for prefix in prefixes)
    assert any(TARGET(prefix) != DRAFT(prefix) for prefix in prefixes)
    assert all(sum(TARGET(prefix)) == 1 for prefix in prefixes)


@pytest.mark.parametrize("gamma", [1, 2, 3])
@pytest.mark.parametrize("greedy_draft", [False, True])
def test_speculative_sequences_have_exactly_the_target_distribution(gamma, greedy_draft):
    expected = target_sequence_distribution(TARGET, 3)
    assert sum(expected.values()) == 1
    assert spec_sequence_distribution(TARGET, DRAFT, gamma, length=3, greedy_draft=greedy_draft) == expected


def test_lossless_after_a_prefix_and_when_draft_equals_target():
    prefix = (2, 0)
    assert spec_sequence_distribution(TARGET, DRAFT, 2, 3, prefix=prefix) == \
        target_sequence_distribution(TARGET, 3, prefix=prefix)
    assert spec_sequence_distribution(TARGET, TARGET, 3, 3) == target_sequence_distribution(TARGET, 3)


def test_draft_equal_to_target_accepts_every_draft():
    outcomes = chain_round_outcomes((), TARGET, TARGET, gamma=3)
    assert all(len(tokens) == 4 for tokens in outcomes)  # 3 accepted drafts + a bonus, every time


def test_resampling_from_p_after_rejection_is_not_lossless():
    gamma = 2
    correct = repeated_rounds_distribution(lambda prefix: chain_round_outcomes(prefix, TARGET, DRAFT, gamma), 3)
    broken = repeated_rounds_distribution(lambda prefix: round_resampling_from_p(prefix, TARGET, DRAFT, gamma), 3)
    expected = target_sequence_distribution(TARGET, 3)
    assert correct == expected  # the assembly of rounds used for the broken variant is itself right
    assert sum(broken.values()) == 1  # the broken rule is still a distribution, just the wrong one
    assert broken != expected
    first_token_broken = [sum(m for seq, m in broken.items() if seq[0] == t) for t in range(3)]
    assert first_token_broken != TARGET(())


def test_greedy_target_and_greedy_draft_emit_the_argmax_path():
    def greedy(model: ToyModel) -> ToyModel:
        def argmax_one_hot(prefix):
            dist = model(prefix)
            return one_hot(max(range(len(dist)), key=lambda t: (dist[t], -t)), len(dist))
        return argmax_one_hot
    distribution = spec_sequence_distribution(greedy(TARGET), DRAFT, 2, 4, greedy_draft=True)
    assert list(distribution.values()) == [1]
    assert distribution == target_sequence_distribution(greedy(TARGET), 4)
