"""When does speculation pay? Expected committed tokens, cycle cost and speedup. Pure functions.

With gamma drafts and conditional acceptance a_i at draft position i (iid: a_i = alpha), a round
commits E[N] = 1 + a_1 + a_1 a_2 + ... + a_1...a_gamma tokens (Leviathan et al. 3.1). One
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


def expected_tokens_by_start(acceptance: Sequence[float], full_share: float, top: int) -> list[float]:
    """E[N] for gamma 0..``top`` when the first draft's acceptance depends on how the previous round
    ended (rejections cluster: right after one, the draft is less often right).

    ``acceptance``: conditional per-position rates measured over rounds of which ``full_share`` were
    fully accepted (so about that share started right after a full acceptance). Model: whether the
    draft matches the target is a two-state chain along the text, p11 = P(match | previous match)
    (position 2's rate: its predecessor was accepted) and p01 = P(match | previous mismatch). A round
    after a rejection starts in the mismatch state: its first rate is p01. After a full acceptance the
    previous position is the bonus token's, a match with probability p11: first rate a1F = p11^2 +
    (1 - p11) p01. The measured a1 = f a1F + (1 - f) p01 gives p01 = (a1 - f p11^2) / (1 - f p11).
    A larger gamma ends fewer rounds fully accepted, so fewer start after one: its share f_g solves
    f_g = f_g P(full | after full) + (1 - f_g) P(full | after rejection), and its first rate is
    a1(g) = f_g a1F + (1 - f_g) p01. Positions 2.. keep their rates (each follows an acceptance).
    The product of the measured rates (``expected_tokens``) applies the first rate of the gammas that
    ran to every gamma, which overestimates deep gammas: enough to make an online policy prefer a gamma
    that is slower than a shallower one (docs/algorithms.md).

    Example: acceptance [0.77, 0.85, 0.85, ...] measured with 55% of rounds fully accepted gives p01
    0.70 and first rates 0.80 / 0.77 / 0.74 at gamma 1 / 3 / 6. On a simulated two-state text (p11
    0.88, p01 0.5) with rates measured at gamma 3, this is within 0.3% of the realised committed
    tokens per round at every gamma 1..8, where the product of rates is -4% at 1 and +8% / +12% at
    6 / 8 (``tests/test_costmodel.py``)."""
    rates = _rates(max(top, 1), None, acceptance)
    a1, p11 = rates[0], (rates[1] if len(rates) > 1 else rates[0])
    f = min(max(full_share, 0.0), 1.0)
    p01 = min(max((a1 - f * p11 * p11) / (1 - f * p11), 0.0), 1.0) if f * p11 < 1 else a1
    after_full = p11 * p11 + (1 - p11) * p01
    out, tail, later = [1.0], 1.0, 1.0  # tail: P(accept 2..g | 1 accepted); later: 1 + a2 + a2 a3 + ...
    for gamma in range(1, top + 1):
        if gamma > 1:
            tail *= rates[gamma - 1]
            later += tail
        from_rejection, from_full = p01 * tail, after_full * tail
        share = from_rejection / (1 - from_full + from_rejection) if 1 - from_full + from_rejection > 0 else 1.0
        first = share * after_full + (1 - share) * p01
        out.append(1 + first * later)
    return out


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
