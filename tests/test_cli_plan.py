"""cli_plan.py: ``verispec plan``: the cost model's numbers for given costs, a sweep's best gamma, and a
profile that is not one refused in one line."""

from __future__ import annotations

import json

import pytest

from verispec.cli import main


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_refuses_a_profile_that_is_not_one(capsys, tmp_path):
    path = tmp_path / "list.json"
    path.write_text("[1, 2]")
    code, _, err = run(capsys, "plan", "--profile", str(path))
    assert code == 2 and "not a verispec profile" in err


COSTS = ["--draft-ms", "1", "--verify-ms", "12", "--baseline-ms", "10"]


def test_plan_json_is_the_cost_model_worked_by_hand(capsys):
    code, out, _ = run(capsys, "plan", "--alpha", "0.8", "--gamma", "4", "--state-ms", "2", *COSTS, "--json")
    expected_tokens = 1 + 0.8 + 0.8 ** 2 + 0.8 ** 3 + 0.8 ** 4  # E[N] = 3.3616
    assert code == 0 and json.loads(out) == pytest.approx({
        "gamma": 4, "expected_tokens": expected_tokens, "cycle_ms": 4 * 1 + 12 + 2,
        "ms_per_token": 18 / expected_tokens, "speedup": 10 / (18 / expected_tokens)})


def test_plan_text_and_a_sweep_that_marks_the_best_gamma(capsys):
    code, out, _ = run(capsys, "plan", "--alpha", "0.8", "--gamma", "4", "--state-ms", "2", *COSTS)
    assert code == 0 and out.splitlines() == ["expected tokens per round  3.3616", "cycle ms                   18",
                                              "ms per token               5.355", "speedup                    1.868x"]
    code, out, _ = run(capsys, "plan", "--acceptance", "0.9,0.5", *COSTS, "--sweep", "3")
    # E[N]: gamma 1: 1.9; gamma 2: 1 + 0.9 + 0.45 = 2.35; gamma 3: 2.35 + 0.225 = 2.575 (the last rate repeats)
    assert code == 0 and out.splitlines() == [
        "gamma  tokens/round  cycle ms  ms/token  speedup",
        "    1        1.9000    13.000     6.842   1.462x",
        "    2        2.3500    14.000     5.957   1.679x",
        "    3        2.5750    15.000     5.825   1.717x  <- best"]


@pytest.mark.parametrize("argv, message", [
    (["--draft-ms", "1"], "give --alpha or --acceptance and --verify-ms, --baseline-ms, or --profile FILE"),
    (["--alpha", "0.8", *COSTS, "--acceptance", "0.5"], "not allowed with argument --alpha"),
    (["--acceptance", "0.5,x", *COSTS], "--acceptance must be comma-separated numbers, got '0.5,x'"),
    (["--alpha", "0.8", "--draft-ms", "0", "--verify-ms", "0", "--baseline-ms", "1"],
     "--baseline-ms must be > 0 and a round must cost something"),
])
def test_plan_input_errors_are_one_line(capsys, argv, message):
    try:
        code, _, err = run(capsys, "plan", *argv)
    except SystemExit as exit_info:  # argparse's own error (mutually exclusive options)
        code, err = exit_info.code, capsys.readouterr().err
    assert code == 2 and message in err and err.count("\n") == 1, err
