"""When does speculation pay? Expected committed tokens, cycle cost and speedup. Pure functions.

With gamma drafts and conditional acceptance a_i at draft position i (iid: a_i = alpha), a round
commits E[N] = 1 + a_1 + a_1 a_2 + ... + a_1...a_gamma tokens (SEED.md; Leviathan et al. 3.1). One
cycle costs gamma * draft_ms + verify_ms(gamma + 1) + state_ms; time per token is cycle / E[N] and the
speedup is baseline_ms / that.

    >>> p = plan(alpha=0.8, gamma=4, draft_ms=1, verify_ms=12, state_ms=2, baseline_ms=10)
    >>> round(p.expected_tokens, 4), p.cycle_ms, round(p.ms_per_token, 3), round(p.speedup, 3)
    (3.3616, 18.0, 5.355, 1.868)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable, Mapping, Sequence

VerifyCost = Callable[[int], float]  # verified positions -> ms


@dataclass(frozen=True)
class Plan:
    gamma: int
    expected_tokens: float
    cycle_ms: float
    ms_per_token: float
    speedup: float

    def as_dict(self) -> dict:
        return asdict(self)


def expected_tokens(gamma: int, alpha: float | None = None, acceptance: Sequence[float] | None = None) -> float:
    """E[N] for iid ``alpha`` or per-position conditional ``acceptance`` (the last value repeats)."""
    rates = _rates(gamma, alpha, acceptance)
    total, reach = 1.0, 1.0
    for rate in rates:
        reach *= rate
        total += reach
    return total


def plan(gamma: int, draft_ms: float, verify_ms: float | VerifyCost, state_ms: float, baseline_ms: float,
         alpha: float | None = None, acceptance: Sequence[float] | None = None,
         measured_cycle_ms: Mapping[int, float] | None = None, read_ms_per_token: float = 0.0,
         measured_tokens: Mapping[int, float] | None = None) -> Plan:
    """Predicted cost of chain speculation with ``gamma`` drafts; gamma 0 is plain decoding.

    ``measured_cycle_ms``: rounds timed in situ per gamma; where one is given it is the cycle (the sum
    of the three costs is the model for gammas not timed). ``read_ms_per_token``: per-token cost outside
    rounds when speculating (the draft reading each prompt, amortised over the tokens decoded).
    ``measured_tokens``: committed tokens per round per gamma from a replay; where given, it replaces
    E[N] from the acceptance rates."""
    if gamma and measured_tokens and gamma in measured_tokens:
        tokens = float(measured_tokens[gamma])
    else:
        tokens = expected_tokens(gamma, alpha, acceptance)
    if gamma and measured_cycle_ms and gamma in measured_cycle_ms:
        cycle = float(measured_cycle_ms[gamma])
    else:
        verify = verify_ms(gamma + 1) if callable(verify_ms) else float(verify_ms)
        cycle = gamma * draft_ms + verify + (state_ms if gamma else 0.0)
    per_token = cycle / tokens + (read_ms_per_token if gamma else 0.0)
    return Plan(gamma, tokens, cycle, per_token, baseline_ms / per_token)


def sweep(gammas: Sequence[int], **kwargs) -> tuple[list[Plan], Plan]:
    """Plans for each gamma and the one with the highest predicted speedup."""
    plans = [plan(gamma, **kwargs) for gamma in gammas]
    return plans, max(plans, key=lambda p: p.speedup)


def linear_verify_cost(base_ms: float, per_position_ms: float) -> VerifyCost:
    """verify_ms(n) = base + (n - 1) * per_position: base is the cost of verifying one position."""
    return lambda positions: base_ms + (positions - 1) * per_position_ms


def _rates(gamma: int, alpha: float | None, acceptance: Sequence[float] | None) -> list[float]:
    if (alpha is None) == (acceptance is None):
        raise ValueError("give exactly one of alpha or acceptance")
    if alpha is not None:
        if not 0 <= alpha <= 1:
            raise ValueError(f"alpha must be in [0, 1], got {alpha}")
        return [alpha] * gamma
    if not acceptance or any(not 0 <= a <= 1 for a in acceptance):
        raise ValueError("acceptance must be a non-empty list of values in [0, 1]")
    return [acceptance[min(i, len(acceptance) - 1)] for i in range(gamma)]
