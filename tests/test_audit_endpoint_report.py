"""audit_endpoint_report.py: an endpoint audit's verdict as an exit status, as JSON and as text, on a
report built by hand."""

from __future__ import annotations

import pytest

from verispec.audit_endpoint_report import EndpointReport, PromptResult, format_report
from verispec.config import SamplingParams
from verispec.two_sample import two_sample_test


def report(verdict="pass", reason=None, logprobs=None) -> EndpointReport:
    test = two_sample_test({"a": 60, "b": 40}, {"a": 50, "b": 50})
    prompt = PromptResult("Hello", None, test, {"length": 100}, {"length": 100}, [["a", 60, 50], ["b", 40, 50]])
    return EndpointReport(verdict, 0.25, test.tv, test.noise_floor, 1e-3, 100, 100, 3, 1,
                          {"url": "http://h:8000", "model": "m"}, {"url": "http://ref:8000", "model": "m"},
                          SamplingParams(temperature=3.0, top_k=4), [prompt], ["a note"], reason, logprobs)


def test_each_verdict_has_its_exit_status():
    assert [report(v).exit_code for v in ("pass", "FAIL", "inconclusive")] == [0, 1, 3]


def test_as_dict_carries_the_sampling_and_each_prompts_test():
    data = report().as_dict()
    assert data["verdict"] == "pass" and data["tv"] == pytest.approx(0.10) and data["alpha"] == 1e-3
    assert data["sampling"] == {"temperature": 3.0, "top_k": 4, "top_p": 1.0, "min_p": 0.0, "presence_penalty": 0.0,
                                "frequency_penalty": 0.0, "repetition_penalty": 1.0}
    prompt = data["prompts"][0]
    assert prompt["prompt"] == "Hello" and prompt["conclusive"] and prompt["dof"] == 1 and prompt["cells"] == 2
    assert prompt["finish_reasons"] == {"length": 100} and prompt["top_texts"][0] == ["a", 60, 50]
    assert data["notes"] == ["a note"] and data["reason"] is None and data["logprobs"] is None


def test_the_text_report_ends_with_the_verdict_and_why():
    lines = format_report(report()).splitlines()
    assert lines[0] == "endpoint audit: http://h:8000 (model m) against http://ref:8000 (model m)"
    assert lines[1] == ("temperature 3, top-k 4, top-p 1, min-p 0; n = 3 tokens, N = 100 (reference 100) per prompt, "
                        "seed 1")
    test = report().prompts[0].test
    assert lines[3].split() == ["'Hello'", "2", "2", "1.00", "0.1000", f"{test.noise_floor:.4f}",
                                f"{test.chi_square:.1f}/1", f"{test.p_value:.3g}"]
    assert lines[4] == "note: a note"
    assert lines[-1] == ("verdict: pass  (p = 0.25 >= alpha 0.001, Bonferroni over 1 prompt(s); TV 0.1000 vs noise "
                         "floor " + f"{report().noise_floor:.4f})")
    undecided = format_report(report("inconclusive", reason="too few samples")).splitlines()[-1]
    assert undecided.startswith("verdict: inconclusive  (too few samples; p = 0.25 >= alpha")
    failed = format_report(report("FAIL", reason="the logprobs disagree")).splitlines()[-1]
    assert failed == "verdict: FAIL  (the logprobs disagree)"


def test_the_logprob_check_gets_a_line_of_its_own():
    check = {"agree": False, "max_spread": 0.4, "max_difference": None, "common": 0, "tolerance": 0.001}
    text = format_report(report("FAIL", reason="the logprobs disagree", logprobs=check))
    assert ("logprobs: DISAGREE (a token sequence's summed logprobs vary by up to 0.4 nats between its samples; "
            "tolerance 0.001)") in text.splitlines()


def test_a_local_target_is_named_as_the_reference():
    local = report()
    local.reference = {"target": "/models/t"}
    first_line = format_report(local).splitlines()[0]
    assert first_line == "endpoint audit: http://h:8000 (model m) against local target /models/t"
