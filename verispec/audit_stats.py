"""The audit's statistics, pure functions of counts and exact probabilities: Pearson chi-square with a
pooled rest cell, its p-value, total variation and its noise floor (the method and a worked example:
``verispec.audit``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

MIN_EXPECTED_COUNT = 5.0


@dataclass(frozen=True)
class Fit:
    """How well counts of sequences follow their exact probabilities (see the module docstring)."""

    samples: int
    distinct: int  # distinct sequences observed
    tv: float
    noise_floor: float
    chi_square: float
    dof: int
    p_value: float
    unseen_mass: float
    impossible: int  # samples of sequences the target gives probability 0


def goodness_of_fit(counts: dict, probs: dict) -> Fit:
    """Chi-square, TV and noise floor of observed ``counts`` against exact ``probs`` (same keys)."""
    samples = sum(counts.values())
    cells = [(min(1.0, max(0.0, probs[key])), count) for key, count in counts.items()]
    unseen = max(0.0, 1.0 - sum(p for p, _ in cells))
    tv = 0.5 * (sum(abs(count / samples - p) for p, count in cells) + unseen)
    floor = 0.5 * sum(binomial_mean_abs_deviation(samples, p) for p, _ in cells) / samples + unseen
    impossible = sum(count for p, count in cells if p == 0)
    if impossible:
        return Fit(samples, len(cells), tv, floor, math.inf, 0, 0.0, unseen, impossible)
    statistic, dof = pearson_with_rest(cells, samples)
    return Fit(samples, len(cells), tv, floor, statistic, dof, chi_square_pvalue(statistic, dof), unseen, 0)


def pearson_with_rest(cells: list[tuple[float, int]], samples: int) -> tuple[float, int]:
    """X^2 and dof over cells (p, count) with expected count >= 5, plus a pooled rest cell."""
    big = sorted((c for c in cells if c[0] * samples >= MIN_EXPECTED_COUNT), reverse=True)
    rest_expected = samples * max(0.0, 1.0 - sum(p for p, _ in big))
    rest_observed = samples - sum(count for _, count in big)
    while big and rest_expected < MIN_EXPECTED_COUNT:  # keep the approximation valid for the rest cell
        p, count = big.pop()
        rest_expected += samples * p
        rest_observed += count
    statistic = sum((count - samples * p) ** 2 / (samples * p) for p, count in big)
    statistic += (rest_observed - rest_expected) ** 2 / rest_expected if rest_expected > 0 else 0.0
    return statistic, len(big)  # cells - 1: the big ones plus the rest


def chi_square_pvalue(statistic: float, dof: int) -> float:
    """P(chi2_dof >= statistic), the regularised upper incomplete gamma Q(dof/2, statistic/2).

    Closed forms for integer dof (y = statistic / 2): even dof = 2m: e^-y sum_{j<m} y^j / j!;
    odd dof = 2m + 1: erfc(sqrt y) + e^-y sum_{j<m} y^(j+1/2) / Gamma(j + 3/2). Terms are positive, so
    the sum has no cancellation; each is formed in log space so large y cannot overflow.
    """
    if dof <= 0 or statistic <= 0:
        return 1.0
    if math.isinf(statistic):
        return 0.0
    y = statistic / 2
    half, offset = divmod(dof, 2)
    shift = 0.5 if offset else 0.0
    total = sum(math.exp((j + shift) * math.log(y) - y - math.lgamma(j + shift + 1)) for j in range(half))
    if offset:
        total += math.erfc(math.sqrt(y))
    return min(1.0, total)


def binomial_mean_abs_deviation(n: int, p: float) -> float:
    """E|X - n p| for X ~ Binomial(n, p), de Moivre: 2 v C(n, v) p^v (1 - p)^(n - v + 1), v = floor(n p) + 1."""
    if p <= 0 or p >= 1:
        return 0.0
    v = math.floor(n * p) + 1
    if v > n:
        return 0.0
    log_value = (math.log(2 * v) + math.lgamma(n + 1) - math.lgamma(v + 1) - math.lgamma(n - v + 1)
                 + v * math.log(p) + (n - v + 1) * math.log1p(-p))
    return math.exp(log_value)
