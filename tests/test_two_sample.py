"""two_sample.py: the endpoint audit's two-sample chi-square with pooled rare texts, TV and its noise
floor, and the verdict over prompts (Bonferroni; inconclusive when the samples cannot decide)."""

from __future__ import annotations

import pytest

from verispec.two_sample import two_sample_test, verdict_of


def test_two_sample_worked_example():
    # Two texts, N = N_ref = 100: pooled 110 / 90, expected 55 / 45 per side.
    test = two_sample_test({"a": 60, "b": 40}, {"a": 50, "b": 50})
    assert test.chi_square == pytest.approx(2 * (5 ** 2 / 55 + 5 ** 2 / 45))
    assert test.dof == 1 and test.cells == 2 and test.coverage == 1.0 and test.conclusive
    assert test.tv == pytest.approx(0.10)
    assert 0.02 < test.noise_floor < 0.10  # E|difference| of two Bin(100, 0.55) / 100 is about 0.056
    assert two_sample_test({"a": 60, "b": 40}, {"a": 50, "b": 50}).noise_floor == test.noise_floor  # seeded


def test_identical_samples_and_pooling():
    same = two_sample_test({"a": 50, "b": 30, "c": 20}, {"a": 100, "b": 60, "c": 40})  # unequal sizes
    assert same.chi_square == pytest.approx(0) and same.p_value == 1.0 and same.tv == pytest.approx(0)
    # rare texts (pooled count < 10 at equal sizes) share one rest cell
    rare = {f"r{i}": 1 for i in range(20)}
    test = two_sample_test({"a": 50, "b": 30, **rare}, {"a": 50, "b": 30, **{f"s{i}": 1 for i in range(20)}})
    assert test.cells == 3 and test.dof == 2 and test.coverage == pytest.approx(160 / 200)
    assert test.chi_square == pytest.approx(0)
    assert test.tv == pytest.approx(20 / 100)  # every rare text is on one side only


def test_inconclusive_when_the_samples_cannot_decide():
    greedy = two_sample_test({"x": 80}, {"x": 80})
    assert greedy.dof == 0 and not greedy.conclusive and "same text" in greedy.reason
    sparse = two_sample_test({f"a{i}": 1 for i in range(100)}, {f"b{i}": 1 for i in range(100)})
    assert not sparse.conclusive and "common enough" in sparse.reason
    half = two_sample_test({"a": 30, **{f"a{i}": 1 for i in range(70)}}, {"a": 30, **{f"b{i}": 1 for i in range(70)}})
    assert half.dof == 1 and half.coverage == pytest.approx(0.3) and not half.conclusive
    assert verdict_of([greedy], 1e-3)[0] == "inconclusive"
    assert verdict_of([half], 1e-3)[0] == "inconclusive"
    disjoint = two_sample_test({"x": 80}, {"y": 80})
    assert verdict_of([disjoint], 1e-3)[:1] == ("FAIL",)  # a sparse or partial test can still fail
    ok = two_sample_test({"a": 60, "b": 40}, {"a": 50, "b": 50})
    verdict, p_value, _ = verdict_of([ok, ok], 1e-3)
    assert verdict == "pass" and p_value == pytest.approx(min(1.0, 2 * ok.p_value))  # Bonferroni
