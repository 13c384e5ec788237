"""Two-sample comparison of sampled texts for the endpoint audit (``verispec audit --endpoint``): a
chi-square over the distinct texts with rare ones pooled (``two_sample_test``, ``pooled_chi_square``),
the total-variation distance against its noise floor, and the verdict over prompts (``verdict_of``).

Cells: a text is a cell of its own when its expected count on each side, min(N, N_ref) x (its pooled
count) / (N + N_ref), is at least 5; the others pool into one rest cell, and if the rest's expected count
is below 5 the smallest cells join it until it is not. X^2 = sum over cells and sides of (observed -
expected)^2 / expected, dof = cells - 1. TV = 1/2 sum_text |c / N - r / N_ref| over every text; its noise
floor is the mean TV over FLOOR_SPLITS seeded re-splits of the pooled samples into sizes N and N_ref.
Verdict: Bonferroni's min(1, k x min p) over k prompts; FAIL below alpha, else pass when every prompt
was testable with at least MIN_COVERAGE of its samples in cells of their own, else inconclusive (why
is given). The method in a user's words: docs/auditing.md."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from verispec.audit import MIN_EXPECTED_COUNT, chi_square_pvalue
from verispec.errors import VerispecError

MIN_COVERAGE = 0.5  # a pass needs at least this share of the samples in cells tested on their own
FLOOR_SPLITS = 200  # random re-splits of the pooled samples that estimate TV's noise floor


@dataclass(frozen=True)
class TwoSample:
    """Two samples of texts compared (see the module docstring)."""

    samples: int
    reference_samples: int
    distinct: int  # distinct texts over both samples
    cells: int  # cells of the chi-square, the rest cell included
    tv: float
    noise_floor: float
    chi_square: float
    dof: int
    p_value: float
    coverage: float  # share of all samples in texts tested on their own (not pooled into the rest)
    reason: str | None = None  # why the samples cannot decide, when they cannot

    @property
    def conclusive(self) -> bool:
        return self.reason is None


def two_sample_test(counts: dict, reference: dict, seed: int = 0) -> TwoSample:
    """Chi-square, TV and its noise floor of text ``counts`` against ``reference`` counts."""
    keys = sorted(set(counts) | set(reference), key=lambda k: (-(counts.get(k, 0) + reference.get(k, 0)), repr(k)))
    x = np.array([counts.get(k, 0) for k in keys], dtype=np.int64)
    y = np.array([reference.get(k, 0) for k in keys], dtype=np.int64)
    n1, n2 = int(x.sum()), int(y.sum())
    if n1 == 0 or n2 == 0:
        raise VerispecError("both samples must be non-empty")
    total = x + y
    tv = 0.5 * float(np.abs(x / n1 - y / n2).sum())
    rng = np.random.default_rng([seed, len(keys), n1, n2])
    split = rng.multivariate_hypergeometric(total, n1, size=FLOOR_SPLITS)  # (R, K): the first sample's counts
    floor = float((0.5 * np.abs(split / n1 - (total - split) / n2).sum(axis=1)).mean())
    statistic, dof, covered = pooled_chi_square(x, y)
    p_value = chi_square_pvalue(statistic, dof)
    coverage = covered / (n1 + n2)
    reason = None
    if dof < 1:
        reason = ("every sample on both sides is the same text: nothing to test (greedy or near-deterministic "
                  "output; raise the temperature)" if len(keys) == 1 else
                  "no text is common enough to test on its own: use fewer --tokens, a lower temperature, "
                  "--top-k, or more --samples")
    elif coverage < MIN_COVERAGE:
        reason = (f"only {coverage:.0%} of the samples fall in texts common enough to test on their own: use fewer "
                  "--tokens, a lower temperature, --top-k, or more --samples")
    return TwoSample(n1, n2, len(keys), dof + 1, tv, floor, statistic, dof, p_value, coverage, reason)


def pooled_chi_square(x: np.ndarray, y: np.ndarray) -> tuple[float, int, int]:
    """X^2, dof and the samples in cells of their own, for counts x, y (sorted by pooled count, largest
    first): cells with an expected count >= 5 on each side, the rest pooled (the module docstring)."""
    n1, n2 = int(x.sum()), int(y.sum())
    total = x + y
    need = MIN_EXPECTED_COUNT * (n1 + n2) / min(n1, n2)  # pooled count that gives each side expected >= 5
    big = int((total >= need).sum())  # sorted descending: the first ``big`` keys
    while big and 0 < total[big:].sum() < need:  # keep the approximation valid for the rest cell too
        big -= 1
    cells = [(int(x[i]), int(y[i])) for i in range(big)]
    if total[big:].sum() > 0:
        cells.append((int(x[big:].sum()), int(y[big:].sum())))
    statistic = 0.0
    for u, v in cells:
        t = u + v
        e1, e2 = n1 * t / (n1 + n2), n2 * t / (n1 + n2)
        statistic += (u - e1) ** 2 / e1 + (v - e2) ** 2 / e2
    return statistic, len(cells) - 1, int(total[:big].sum())


def verdict_of(tests: Sequence[TwoSample], alpha: float) -> tuple[str, float, str | None]:
    """Verdict, combined p-value and, when inconclusive, why (see the module docstring)."""
    tested = [t for t in tests if t.dof >= 1]
    if not tested:
        reason = tests[0].reason if len(tests) == 1 else f"no prompt could be tested ({tests[0].reason})"
        return "inconclusive", 1.0, reason
    p_value = min(1.0, len(tested) * min(t.p_value for t in tested))
    if p_value < alpha:
        return "FAIL", p_value, None
    undecided = [t.reason for t in tests if not t.conclusive]
    if undecided:
        return "inconclusive", p_value, undecided[0]
    return "pass", p_value, None
