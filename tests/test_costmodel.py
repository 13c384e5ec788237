"""Cost model: the figures of docs/algorithms.md (The cost model and the planner) exactly,
per-position acceptance, sweeps, and the plan CLI."""

import json
import random

import pytest

from verispec import costmodel
from verispec.adaptive import AcceptanceCounts
from verispec.costmodel import expected_tokens, expected_tokens_by_start
from verispec.cli import main


def test_worked_example_figures():
    first = costmodel.plan(alpha=0.8, gamma=4, draft_ms=1, verify_ms=12, state_ms=2, baseline_ms=10)
    second = costmodel.plan(alpha=0.9, gamma=4, draft_ms=3, verify_ms=12, state_ms=2, baseline_ms=10)
    assert (round(first.expected_tokens, 4), first.cycle_ms, round(first.ms_per_token, 3), round(first.speedup, 3)) \
        == (3.3616, 18, 5.355, 1.868)
    assert (round(second.expected_tokens, 4), second.cycle_ms, round(second.ms_per_token, 3), round(second.speedup, 3)) \
        == (4.0951, 26, 6.349, 1.575)


def test_per_position_acceptance_generalises_alpha():
    assert costmodel.expected_tokens(4, acceptance=[0.8]) == pytest.approx(costmodel.expected_tokens(4, alpha=0.8))
    # 1 + 0.9 + 0.9*0.5 + 0.9*0.5*0.5
    assert costmodel.expected_tokens(3, acceptance=[0.9, 0.5]) == pytest.approx(1 + 0.9 + 0.45 + 0.225)
    assert costmodel.expected_tokens(0, alpha=0.5) == 1.0
    with pytest.raises(ValueError):
        costmodel.expected_tokens(2, alpha=1.5)


def test_sweep_picks_the_best_gamma():
    verify = costmodel.linear_verify_cost(10, 1)
    plans, best = costmodel.sweep(range(1, 9), alpha=0.7, draft_ms=1, verify_ms=verify, state_ms=0, baseline_ms=10)
    assert best.speedup == max(p.speedup for p in plans)
    assert plans[0].cycle_ms == 1 + 11  # gamma 1 verifies 2 positions


def test_measured_cycles_and_read_cost_enter_the_plan():
    kwargs = dict(draft_ms=1, verify_ms=12, state_ms=2, baseline_ms=10, alpha=0.8)
    modelled = costmodel.plan(4, **kwargs)
    measured = costmodel.plan(4, measured_cycle_ms={4: 20.0}, read_ms_per_token=0.5, **kwargs)
    assert measured.cycle_ms == 20.0 and modelled.cycle_ms == 18.0
    assert measured.ms_per_token == pytest.approx(20.0 / 3.3616 + 0.5)
    assert measured.speedup == pytest.approx(10 / (20.0 / 3.3616 + 0.5))
    # An untimed gamma falls back to the model; gamma 0 is plain decoding and pays no reads.
    assert costmodel.plan(3, measured_cycle_ms={4: 20.0}, **kwargs).cycle_ms == 3 * 1 + 12 + 2
    plain = costmodel.plan(0, measured_cycle_ms={4: 20.0}, read_ms_per_token=0.5, **kwargs)
    assert plain.speedup == pytest.approx(10 / 12)  # verify_ms(1) = 12 here is the modelled plain step


def test_plan_cli_json(capsys):
    assert main(["plan", "--alpha", "0.8", "--gamma", "4", "--draft-ms", "1", "--verify-ms", "12",
                 "--state-ms", "2", "--baseline-ms", "10", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert round(data["expected_tokens"], 4) == 3.3616 and data["cycle_ms"] == 18
    assert round(data["ms_per_token"], 3) == 5.355 and round(data["speedup"], 3) == 1.868


def test_plan_cli_sweep_marks_best(capsys):
    assert main(["plan", "--acceptance", "0.9,0.7", "--draft-ms", "1", "--verify-ms", "12",
                 "--verify-slope-ms", "1", "--baseline-ms", "10", "--sweep", "6"]) == 0
    out = capsys.readouterr().out
    assert out.count("<- best") == 1 and len(out.strip().splitlines()) == 7


def test_plan_cli_rejects_bad_values(capsys):
    assert main(["plan", "--alpha", "1.2", "--draft-ms", "1", "--verify-ms", "1", "--baseline-ms", "1"]) == 2
    assert main(["plan", "--acceptance", "a,b", "--draft-ms", "1", "--verify-ms", "1", "--baseline-ms", "1"]) == 2
    assert "Traceback" not in capsys.readouterr().err


def _greedy_chain(matches: list[bool], gamma: int):
    """Greedy chain rounds over a text whose draft-matches-target flags are ``matches``: per-position
    counts, committed tokens per round, and the share of rounds that accepted every draft."""
    counts, position, rounds, committed = AcceptanceCounts(), 0, 0, 0
    while position + gamma + 1 < len(matches):
        accepted = 0
        while accepted < gamma and matches[position + accepted]:
            accepted += 1
        counts.add(accepted, gamma)
        rounds, committed = rounds + 1, committed + accepted + 1
        position += accepted + 1  # the next round drafts after the recovered or bonus token
    return counts, committed / rounds


def test_expected_tokens_by_start_predicts_other_gammas_where_the_product_of_rates_does_not():
    """Matches clustered like real text (a two-state chain, P(match | match) 0.88, P(match |
    mismatch) 0.5): rates measured at gamma 3 predict every gamma's committed tokens per round within
    1% with the start correction; the product of the same rates is 3% low at gamma 1 and 10% high at 8."""
    rng, matches, previous = random.Random(0), [], True
    for _ in range(150_000):
        previous = rng.random() < (0.88 if previous else 0.5)
        matches.append(previous)
    counts, _ = _greedy_chain(matches, 3)
    rates = counts.rates(8)
    corrected = expected_tokens_by_start(rates, counts.full_share(), 8)
    assert corrected[0] == 1.0
    for gamma in range(1, 9):
        realised = _greedy_chain(matches, gamma)[1]
        assert corrected[gamma] == pytest.approx(realised, rel=0.01), gamma
    assert expected_tokens(1, acceptance=rates) < 0.97 * _greedy_chain(matches, 1)[1]
    assert expected_tokens(8, acceptance=rates) > 1.10 * _greedy_chain(matches, 8)[1]
    # Independent matches (no clustering): both agree, and agree with iid alpha.
    assert expected_tokens_by_start([0.8] * 8, 0.8 ** 4, 4)[4] == pytest.approx(expected_tokens(4, alpha=0.8))


def test_the_adaptive_policy_corrects_for_round_starts_once_it_has_seen_enough_rounds():
    from verispec.adaptive import AdaptiveGamma
    policy = AdaptiveGamma(max_gamma=8)
    outcomes = [3, 0, 3, 3, 1, 0, 3, 2, 3, 3]  # accepted of 3 drafts, 6 of 10 rounds fully accepted
    for accepted in outcomes:
        policy.observe(1, 3, 0.004, [accepted], [3])
    rates = policy.acceptance()
    assert policy.expected(rates, 8) == [expected_tokens(g, acceptance=rates) if g else 1.0 for g in range(9)]
    for accepted in outcomes:
        policy.observe(1, 3, 0.004, [accepted], [3])
    assert policy.counts.full_share() == pytest.approx(0.6)
    assert policy.expected(rates, 8) == expected_tokens_by_start(rates, 0.6, 8)
