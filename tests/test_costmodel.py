"""Cost model: SEED.md's figures exactly, per-position acceptance, sweeps, and the plan CLI."""

import json

import pytest

from verispec import costmodel
from verispec.cli import main


def test_seed_figures():
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
