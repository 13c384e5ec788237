"""verispec plan --emit: the planner's best gamma per batch size, in vLLM / TensorRT-LLM / SGLang syntax."""

import json

import pytest
import yaml

from verispec import costmodel
from verispec.cli import main
from verispec.plan_emit import BATCH_SIZES, batch_profile, extend
from verispec.profile import plan_from_profile

MAX_GAMMA = 8


def synthetic_profile(per_position_ms: float) -> dict:
    """Shaped like ``verispec profile --out``: a verify curve flat for a few positions, then rising."""
    verify = {str(n): 10.0 + 0.1 * (n - 1) + per_position_ms * max(0, n - 4) for n in range(1, 17)}
    return {"verify_ms": verify, "decode_ms": verify["1"], "draft_ms": 1.0, "state_ms": 0.2,
            "tree_verify_ms": {}, "calibration": {"gamma": 2, "acceptance": [0.8, 0.85]}}


def planner_best(profile_data: dict, batch_size: int) -> int:
    return plan_from_profile(batch_profile(profile_data, batch_size, MAX_GAMMA), None, MAX_GAMMA)[1].gamma


@pytest.fixture
def profile_path(tmp_path):
    def write(per_position_ms: float = 2.0):
        path = tmp_path / "profile.json"
        path.write_text(json.dumps(synthetic_profile(per_position_ms)))
        return path
    return write


def test_vllm_schedule_is_the_planners_best_gamma_per_batch_size(profile_path, capsys):
    path = profile_path()
    assert main(["plan", "--profile", str(path), "--emit", "vllm"]) == 0
    config = json.loads(capsys.readouterr().out)
    data = synthetic_profile(2.0)
    assert config["num_speculative_tokens_per_batch_size"] == [[b, planner_best(data, b)] for b in BATCH_SIZES]
    assert config["num_speculative_tokens"] == planner_best(data, 1) > 0
    # batch 1 is the plain planner's own choice, on the profile as it is
    assert config["num_speculative_tokens"] == plan_from_profile(data, None, MAX_GAMMA)[1].gamma


def test_trtllm_schedule_parses_as_yaml(profile_path, capsys):
    assert main(["plan", "--profile", str(profile_path()), "--emit", "trtllm"]) == 0
    config = yaml.safe_load(capsys.readouterr().out)["speculative_config"]
    data = synthetic_profile(2.0)
    assert config["draft_len_schedule"] == {b: planner_best(data, b) for b in BATCH_SIZES}
    assert config["max_draft_len"] == max(config["draft_len_schedule"].values())


def test_costly_verification_turns_speculation_off_at_large_batch(profile_path, capsys):
    assert main(["plan", "--profile", str(profile_path(5.0)), "--emit", "vllm"]) == 0
    schedule = dict(json.loads(capsys.readouterr().out)["num_speculative_tokens_per_batch_size"])
    assert schedule[1] > 0 and schedule[64] == 0
    assert list(schedule.values()) == sorted(schedule.values(), reverse=True)


def test_sglang_flags_for_the_chosen_batch_size(profile_path, capsys):
    path = profile_path()
    assert main(["plan", "--profile", str(path), "--emit", "sglang"]) == 0
    gamma = planner_best(synthetic_profile(2.0), 1)
    assert capsys.readouterr().out.split() == ["--speculative-num-steps", str(gamma),
                                               "--speculative-num-draft-tokens", str(gamma + 1),
                                               "--speculative-eagle-topk", "1"]
    assert main(["plan", "--profile", str(path), "--emit", "sglang", "--batch-size", "64"]) == 0
    captured = capsys.readouterr()
    assert captured.out == "" and "does not pay" in captured.err


def test_emit_from_hand_given_costs_matches_the_cost_model(capsys):
    args = ["plan", "--alpha", "0.8", "--draft-ms", "1", "--verify-ms", "12", "--verify-slope-ms", "1",
            "--baseline-ms", "10", "--emit", "vllm", "--json"]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    verify = costmodel.linear_verify_cost(12 - 4 * 1, 1)  # --verify-ms is the cost at --gamma 4
    expected = []
    for b in BATCH_SIZES:
        scale = verify(b) / verify(1)
        _, best = costmodel.sweep(range(MAX_GAMMA + 1), verify_ms=lambda n, b=b: verify(b * n), draft_ms=scale,
                                  baseline_ms=10 * scale, state_ms=0.0, alpha=0.8)
        expected.append([b, best.gamma])
    assert out["schedule"] == expected
    assert json.loads(out["config"])["num_speculative_tokens_per_batch_size"] == expected
    assert expected[0][1] > 0 and expected[-1][1] == 0


def test_extend_interpolates_and_extrapolates_the_verify_curve():
    curve = extend({1: 10.0, 2: 10.0, 4: 12.0, 8: 16.0})
    assert [curve(n) for n in (1, 2, 3, 4, 8, 16)] == [10.0, 10.0, 11.0, 12.0, 16.0, 24.0]


@pytest.mark.parametrize("args, message", [
    (["--alpha", "0.8", "--emit", "vllm"], "give --alpha"),
    (["--alpha", "0.8", "--draft-ms", "1", "--verify-ms", "12", "--baseline-ms", "10", "--emit", "tgi"],
     "--emit must be one of"),
    (["--alpha", "0.8", "--draft-ms", "1", "--verify-ms", "12", "--baseline-ms", "10", "--emit", "sglang",
      "--batch-size", "0"], "--batch-size must be >= 1"),
])
def test_bad_emit_combinations_are_one_line_errors(args, message, capsys):
    assert main(["plan", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_emit_from_a_profile_without_acceptance_is_an_error(tmp_path, capsys):
    data = synthetic_profile(2.0)
    del data["calibration"]
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(data))
    assert main(["plan", "--profile", str(path), "--emit", "trtllm"]) == 2
    err = capsys.readouterr().err
    assert "no acceptance" in err and err.count("\n") == 1
