"""audit_stats.py: the audit's goodness-of-fit statistics (chi-square with a pooled rest cell, its
p-value, total variation and the binomial noise floor), checked on worked examples and slow oracles."""

from __future__ import annotations

import math

import pytest

from verispec.audit_stats import binomial_mean_abs_deviation, chi_square_pvalue, goodness_of_fit


def test_worked_example_of_the_docstring():
    fit = goodness_of_fit({"A": 45, "B": 38, "C": 17}, {"A": 0.5, "B": 0.3, "C": 0.2})
    assert fit.tv == pytest.approx(0.08)
    assert fit.chi_square == pytest.approx(3.0833, abs=1e-4) and fit.dof == 2
    assert fit.p_value == pytest.approx(math.exp(-fit.chi_square / 2))
    assert fit.noise_floor == pytest.approx(0.054, abs=5e-4)
    assert fit.unseen_mass == 0 and fit.impossible == 0


@pytest.mark.parametrize("statistic,dof", [(3.08, 2), (0.5, 1), (10.0, 3), (200.0, 150), (2500.0, 2000),
                                           (1e4, 2000), (1e-3, 7), (40.0, 11)])
def test_chi_square_pvalue_matches_scipy(statistic, dof):
    scipy_stats = pytest.importorskip("scipy.stats")
    assert chi_square_pvalue(statistic, dof) == pytest.approx(scipy_stats.chi2.sf(statistic, dof), rel=1e-9, abs=1e-300)


@pytest.mark.parametrize("n,p", [(100, 0.5), (1000, 0.003), (37, 0.9), (5, 0.01), (250, 0.2)])
def test_binomial_mean_abs_deviation_matches_direct_sum(n, p):
    direct = sum(math.comb(n, k) * p ** k * (1 - p) ** (n - k) * abs(k - n * p) for k in range(n + 1))
    assert binomial_mean_abs_deviation(n, p) == pytest.approx(direct, rel=1e-9)


def test_rare_cells_are_pooled_with_the_unseen_mass():
    # Two big cells (expected 60, 30) and a rare seen one (p 0.001); unseen mass 0.099 -> rest expected 10.
    fit = goodness_of_fit({"a": 60, "b": 30, "c": 1}, {"a": 0.6, "b": 0.3, "c": 0.001})
    assert fit.samples == 91 and fit.dof == 2 and fit.unseen_mass == pytest.approx(0.099)
    expected = [0.6 * 91, 0.3 * 91, 0.1 * 91]
    observed = [60, 30, 1]
    assert fit.chi_square == pytest.approx(sum((o - e) ** 2 / e for o, e in zip(observed, expected)))


def test_a_sequence_the_target_cannot_produce_fails_outright():
    fit = goodness_of_fit({"a": 99, "z": 1}, {"a": 1.0, "z": 0.0})
    assert fit.p_value == 0.0 and fit.impossible == 1
