"""Goodness-of-fit helpers for the statistical tests: does a sample of tokens follow a distribution?

Two checks, both must pass:

* Pearson chi-square (scipy.stats.chisquare). Cells the expected distribution gives zero mass are
  dropped when empty; a single observation in one is an outright failure (p-value 0), because a lossless
  sampler can never produce it. Cells with expected count below 5 are pooled, so the chi-square
  approximation holds.
* Total variation TV = 1/2 sum |empirical - expected| below ``tv_bound(V, N) = 3 sqrt(V / N)``.
  Why that bound: E|p^_i - p_i| <= sqrt(p_i (1 - p_i) / N), so by Cauchy-Schwarz E[TV] <= 1/2 sqrt(V/N);
  TV moves by at most 1/N when one sample changes, so McDiarmid gives P(TV > E[TV] + t) <= exp(-2 N t^2).
  With t = 2.5 sqrt(V/N) that is exp(-12.5 V) < 1e-10 for V >= 2: a correct sampler essentially never
  fails, while a biased one fails once its bias exceeds the bound.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.stats import chisquare

MIN_PVALUE = 1e-4
MIN_EXPECTED_COUNT = 5.0


@dataclass(frozen=True)
class FitResult:
    pvalue: float
    total_variation: float
    tv_bound: float

    @property
    def passes(self) -> bool:
        return self.pvalue > MIN_PVALUE and self.total_variation < self.tv_bound


def tv_bound(num_cells: int, num_samples: int) -> float:
    return 3.0 * np.sqrt(num_cells / num_samples)


def fit_to_distribution(samples: np.ndarray, expected: np.ndarray) -> FitResult:
    """How well integer ``samples`` (N,) in [0, C) follow ``expected`` (C,) probabilities."""
    expected = np.asarray(expected, dtype=np.float64)
    expected = expected / expected.sum()
    num_samples = len(samples)
    observed = np.bincount(np.asarray(samples), minlength=len(expected)).astype(np.float64)
    assert len(observed) == len(expected), "a sample lies outside the expected support's index range"
    total_variation = 0.5 * np.abs(observed / num_samples - expected).sum()
    bound = tv_bound(len(expected), num_samples)
    if observed[expected == 0].sum() > 0:
        return FitResult(0.0, total_variation, bound)
    return FitResult(_chisquare_pvalue(observed[expected > 0], expected[expected > 0] * num_samples),
                     total_variation, bound)


def _chisquare_pvalue(observed: np.ndarray, expected_counts: np.ndarray) -> float:
    # Pool the cells with small expected counts (smallest first) into one cell of count >= 5.
    order = np.argsort(expected_counts)
    observed, expected_counts = observed[order], expected_counts[order]
    small = np.cumsum(expected_counts) < MIN_EXPECTED_COUNT
    if small.any():
        num_pooled = int(small.sum()) + 1
        observed = np.concatenate([[observed[:num_pooled].sum()], observed[num_pooled:]])
        expected_counts = np.concatenate([[expected_counts[:num_pooled].sum()], expected_counts[num_pooled:]])
    if len(observed) < 2:
        return 1.0  # one cell carries everything: nothing to test beyond the zero-mass cells
    expected_counts = expected_counts * observed.sum() / expected_counts.sum()
    return float(chisquare(observed, expected_counts).pvalue)


def describe(result: FitResult) -> str:
    return (f"p-value {result.pvalue:.3g} (need > {MIN_PVALUE}), "
            f"TV {result.total_variation:.4f} (need < {result.tv_bound:.4f})")
