"""policy_trace.py: ``PolicyTrace`` writes one JSON line per round of what a gamma policy was told and
chose, and passes every call through to the policy it wraps."""

from __future__ import annotations

import json

import pytest

from verispec.adaptive import AdaptiveGamma
from verispec.errors import VerispecError
from verispec.gamma_policies import Backlog, HFHeuristicGamma
from verispec.policy_trace import PolicyTrace


def read_lines(path) -> list[dict]:
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    for line in lines[1:]:
        assert line.pop("t") >= 0  # seconds since the trace opened
    return lines


def test_each_round_is_one_line_and_the_wrapped_policy_sees_every_call(tmp_path):
    path = tmp_path / "rounds.jsonl"
    trace = PolicyTrace(HFHeuristicGamma(initial=2, max_gamma=4), path)
    assert trace.max_gamma == 4  # anything else is the wrapped policy's
    gamma = trace.choose(2)
    assert gamma == 2 and trace.afford(2, gamma, Backlog(30, 100)) == 2
    trace.reads(30, 0.003)
    trace.charge(2, 0.001, prompts=1)
    trace.observe(2, gamma, 0.0125, [2, 1], [2, 2])
    assert trace.choose(2) == 1  # the heuristic saw a round that was not fully accepted: -1
    trace.observe(2, 1, 0.01, [0, 0], [1, 0])
    trace.close()
    start, first, second = read_lines(path)
    assert start["policy"] == "HFHeuristicGamma" and start["start"] > 0
    assert first == {"batch": 2, "load": 2, "chosen": 2, "backlog": 30, "remaining": 100, "read_tokens": 30,
                     "read_s": 0.003, "charged_s": 0.001, "prompts": 1, "gamma": 2, "seconds": 0.0125,
                     "drafted": 2, "accepted": 3}
    assert second == {"batch": 2, "load": 2, "chosen": 1, "gamma": 1, "seconds": 0.01, "drafted": 1, "accepted": 0}
    PolicyTrace(HFHeuristicGamma(), path).close()  # a second start appends
    assert len(path.read_text().splitlines()) == 4 and "start" in json.loads(path.read_text().splitlines()[-1])


def test_an_adaptive_policy_adds_its_price_per_read_token(tmp_path):
    path = tmp_path / "rounds.jsonl"
    trace = PolicyTrace(AdaptiveGamma(max_gamma=2, candidates=(0, 1, 2)), path)
    trace.policy.reads(1000, 0.05)  # an earlier round's reads: 50 us per token
    gamma = trace.choose(1)
    trace.afford(1, gamma, Backlog(0, 10))
    trace.observe(1, gamma, 0.01, [0], [gamma])
    trace.close()
    round_line = read_lines(path)[1]
    assert round_line["read_price"] == pytest.approx(5e-05) and "gain" in round_line
    assert "read_tokens" not in round_line  # this round read nothing


def test_a_policy_without_the_protocol_is_refused_before_a_file_is_opened(tmp_path):
    with pytest.raises(VerispecError, match="object does not implement the GammaPolicy protocol: missing choose"):
        PolicyTrace(object(), tmp_path / "rounds.jsonl")
    assert not (tmp_path / "rounds.jsonl").exists()
