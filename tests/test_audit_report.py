"""audit_report.py: what an audit is asked (``AuditConfig``'s bounds, each with its message) and what it
reports (``AuditReport`` as JSON and as text), on a report built by hand."""

from __future__ import annotations

import pytest

from verispec.audit_report import AuditConfig, AuditReport, PromptAudit, format_report, prompt_label
from verispec.audit_stats import goodness_of_fit
from verispec.config import SamplingParams, SpecConfig
from verispec.errors import VerispecError


@pytest.mark.parametrize("fields, message", [
    (dict(tokens=0), "--tokens must be in 1..8 (the audit scores every sequence of that length exactly), got 0"),
    (dict(tokens=9), "--tokens must be in 1..8"),
    (dict(samples=49), "--samples must be >= 50 for a meaningful test, got 49"),
    (dict(alpha=0.0), "--alpha must be in (0, 1), got 0.0"),
    (dict(alpha=1.0), "--alpha must be in (0, 1)"),
    (dict(seed=-1), "--seed must be >= 0 for an audit, got -1"),
])
def test_audit_config_refuses_what_cannot_be_tested(fields, message):
    with pytest.raises(VerispecError) as caught:
        AuditConfig(**fields)
    assert message in str(caught.value)


def test_audit_config_defaults_and_edges():
    assert AuditConfig() == AuditConfig(tokens=4, samples=1000, seed=0, alpha=1e-3)
    AuditConfig(tokens=1, samples=50)
    AuditConfig(tokens=8, alpha=0.5)


def test_prompt_labels_are_cut_to_24_characters():
    assert prompt_label("abab", [1, 2]) == "'abab'"  # the text wins over the ids
    assert prompt_label(None, [1, 2, 3]) == "[1, 2, 3]"
    label = prompt_label("a long prompt that does not fit", None)
    assert label == "'a long prompt that d..." and len(label) == 24


def report() -> AuditReport:
    fit = goodness_of_fit({"A": 45, "B": 38, "C": 17}, {"A": 0.5, "B": 0.3, "C": 0.2})  # TV 0.08, chi2 3.08
    prompt = PromptAudit([1, 2, 3], fit, drafted=40, accepted=30)
    return AuditReport("pass", fit.p_value, fit.tv, fit.noise_floor, AuditConfig(tokens=3, samples=100, seed=7),
                       SamplingParams(temperature=0.8, top_k=3), SpecConfig(gamma=2), [prompt], ["a note"])


def test_as_dict_names_the_config_and_each_prompts_fit():
    data = report().as_dict()
    assert (data["verdict"], data["samples"], data["tokens"], data["seed"], data["alpha"]) == ("pass", 100, 3, 7, 1e-3)
    assert data["config"]["sampling"] == {"temperature": 0.8, "top_k": 3, "top_p": 1.0, "min_p": 0.0,
                                          "presence_penalty": 0.0, "frequency_penalty": 0.0,
                                          "repetition_penalty": 1.0, "grammar": None}
    assert data["config"]["spec"]["gamma"] == 2 and "extra" not in data["config"]["spec"]
    prompt = data["prompts"][0]
    assert prompt["prompt_ids"] == [1, 2, 3] and prompt["prompt"] is None
    assert prompt["tv"] == pytest.approx(0.08) and prompt["dof"] == 2 and prompt["accepted"] == 30
    assert data["notes"] == ["a note"]


def test_the_text_report():
    item = report()
    lines = format_report(item).splitlines()
    assert lines[0] == ("audit: chain, temperature 0.8, top-k 3, top-p 1, min-p 0; n = 3 tokens, N = 100 per prompt, "
                        "seed 7")
    assert lines[2].split() == ["[1,", "2,", "3]", "3", "0.0000", "0.0800", f"{item.noise_floor:.4f}", "3.1/2",
                                f"{item.p_value:.3g}", "30/40"]
    assert lines[3] == "note: a note"
    assert lines[4] == (f"verdict: pass  (p = {item.p_value:.3g} >= alpha 0.001, Bonferroni over 1 prompt(s); "
                        f"TV 0.0800 vs noise floor {item.noise_floor:.4f})")
    item.verdict = "FAIL"
    assert format_report(item).splitlines()[-1].startswith(f"verdict: FAIL  (p = {item.p_value:.3g} < alpha 0.001")
    item.spec = SpecConfig(gamma=2, drafter="ngram")
    assert format_report(item).startswith("audit: chain (ngram), temperature 0.8")
