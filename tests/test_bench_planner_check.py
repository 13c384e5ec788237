"""verispec.bench.planner_check: predicted vs realised speedup per gamma, end to end on the tiny random
pair, and the held-out scoring of the best fixed gamma from hand-made figures."""

from __future__ import annotations

import pytest


def test_planner_check_reports_predicted_and_realised_per_gamma(tmp_path, capsys, byte_pair):
    """The planner check runs end to end; its verdicts follow from its own figures."""
    import json

    from verispec.bench import planner_check

    target, draft = byte_pair
    out = tmp_path / "check.json"
    assert planner_check.main(["--target", str(target), "--draft", str(draft), "--prompts", "1", "--max-tokens", "6",
                               "--repeats", "1", "--max-gamma", "2", "--profile-repeats", "2", "--json",
                               "--out", str(out)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data == json.loads(out.read_text())
    assert [row["gamma"] for row in data["rows"]] == [1, 2]
    for row in data["rows"]:
        assert row["error"] == pytest.approx(row["realised_speedup"] / row["predicted_speedup"] - 1)
        scaled = row["predicted_speedup"] * row["realised_committed_per_round"] / row["predicted_tokens_per_round"]
        assert row["cost_error"] == pytest.approx(row["realised_speedup"] / scaled - 1)
    best = max([1.0] + [row["realised_speedup"] for row in data["rows"]])
    assert data["best_realised_speedup"] == pytest.approx(best)
    assert data["planner_within_5pct_of_best"] == (data["planner_choice_realised"] >= 0.95 * best)
    assert data["settings"]["evaluation_prompts"] == 3 and data["settings"]["calibration_prompts"] > 0


def test_planner_check_scores_the_best_fixed_gamma_on_held_out_repeats():
    from verispec.bench.planner_check import report

    speeds = {"off": [1.0, 1.0, 1.0], "gamma1": [1.2, 1.5, 1.2], "gamma2": [1.4, 1.1, 1.3],
              "adaptive": [1.25, 1.25, 1.25], "hf": [1.0, 1.0, 1.0]}
    measured = {name: {"s_per_token": [1 / v for v in values], "drafted_per_round": [{}, {}, {}],
                       "committed_per_round": 2.0} for name, values in speeds.items()}
    profile_data = {"verify_ms": {"1": 5.0, "2": 5.5, "3": 6.0}, "decode_ms": 5.0, "draft_ms": 0.5,
                    "state_ms": 0.1, "threads": 1}
    data = report(profile_data, [0.8, 0.8], measured, [1, 2])
    # Best realised median: gamma 2 (1.3x). Held out: repeat 0 picks gamma 1 (1.35 vs 1.2 on repeats
    # 1-2) and scores 1.2; repeat 1 picks gamma 2 (1.35 vs 1.2), 1.1; repeat 2 picks gamma 1, 1.2.
    assert data["best_realised_speedup"] == pytest.approx(1.3)
    assert [h["gamma"] for h in data["best_fixed_held_out_picks"]] == [1, 2, 1]
    assert data["best_fixed_held_out"] == pytest.approx(1.2)
    assert not data["adaptive_at_least_best_fixed"] and data["adaptive_at_least_best_fixed_held_out"]
