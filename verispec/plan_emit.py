"""``verispec plan --emit ENGINE``: the planner's draft length per batch size, in another engine's syntax.

Batch model (an assumption; the profile measures batch 1 only): a round at batch size B verifies
B * (gamma + 1) positions in one forward, so it costs what the batch-1 verify curve charges for that
many positions, ``verify(B * n)``; plain decoding at B costs ``verify(B)``, and a draft step costs
``draft_ms * verify(B) / verify(1)`` (the draft is assumed to scale with tokens per forward as the target
does). Per-token cost and speedup then follow from the one cost model (``costmodel.plan``, through
``profile.plan_from_profile`` for a profile). Past the last measured position the curve is extended
along the slope of its upper half. In-situ round timings of a calibration were taken at batch 1 and
are used there only. Example, a curve flat up to 2 positions, then +1 ms per position:

    >>> curve = extend({1: 10.0, 2: 10.0, 4: 12.0, 8: 16.0})
    >>> curve(3), curve(8), curve(16)
    (11.0, 16.0, 24.0)

The engines' key names (vLLM ``num_speculative_tokens_per_batch_size``, TensorRT-LLM
``draft_len_schedule``) were written without access to those projects: check them against the version
you run (docs/benchmarking.md).
"""

from __future__ import annotations

import json
from typing import Sequence

from verispec import costmodel
from verispec.profile import monotone, plan_from_profile

ENGINES = ("vllm", "trtllm", "sglang")
BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)

Schedule = list[tuple[int, int]]  # (batch size, best gamma; 0 = speculation off)


def extend(curve: dict[int, float]) -> costmodel.VerifyCost:
    """ms for any number of positions from a measured {positions: ms} curve (made non-decreasing):
    measured points as they are, linear between them, linear beyond the last along the slope of the
    upper half."""
    xs = sorted(curve)
    ys = monotone([curve[x] for x in xs])
    mid = xs[len(xs) // 2] if len(xs) > 1 else xs[0]
    slope = (ys[-1] - ys[xs.index(mid)]) / (xs[-1] - mid) if xs[-1] > mid else 0.0

    def cost(positions: int) -> float:
        if positions >= xs[-1]:
            return ys[-1] + (positions - xs[-1]) * slope
        for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
            if positions <= x1:
                return y0 + (y1 - y0) * (max(positions, x0) - x0) / (x1 - x0)
        return ys[0]

    return cost


def batch_profile(profile_data: dict, batch_size: int, max_gamma: int) -> dict:
    """The profile as batch ``batch_size`` would see it under the batch model (batch 1: unchanged)."""
    if batch_size == 1:
        return profile_data
    verify = extend({int(n): ms for n, ms in profile_data["verify_ms"].items()})
    scale = verify(batch_size) / verify(1)
    calibration = {k: v for k, v in profile_data.get("calibration", {}).items() if k != "in_situ"}
    return {**profile_data, "verify_ms": {str(n): verify(batch_size * n) for n in range(1, max_gamma + 2)},
            "decode_ms": verify(batch_size), "draft_ms": profile_data["draft_ms"] * scale,
            "calibration": calibration}


def schedule_from_profile(profile_data: dict, acceptance: list[float] | None, max_gamma: int,
                          batch_sizes: Sequence[int] = BATCH_SIZES) -> Schedule:
    """Best gamma per batch size: ``plan_from_profile`` on each batch's view of the profile."""
    return [(b, plan_from_profile(batch_profile(profile_data, b, max_gamma), acceptance, max_gamma)[1].gamma)
            for b in batch_sizes]


def schedule_from_costs(verify: costmodel.VerifyCost, max_gamma: int, draft_ms: float, baseline_ms: float,
                        batch_sizes: Sequence[int] = BATCH_SIZES, **plan_kwargs) -> Schedule:
    """Best gamma per batch size from hand-given costs (``verify``: batch-1 ms per verified positions);
    ``plan_kwargs``: state_ms and alpha or acceptance, as ``costmodel.plan`` takes them."""
    out = []
    for b in batch_sizes:
        scale = verify(b) / verify(1)
        _, best = costmodel.sweep(range(0, max_gamma + 1), verify_ms=_at_batch(verify, b), draft_ms=draft_ms * scale,
                                  baseline_ms=baseline_ms * scale, **plan_kwargs)
        out.append((b, best.gamma))
    return out


def _at_batch(verify: costmodel.VerifyCost, batch_size: int) -> costmodel.VerifyCost:
    return lambda positions: verify(batch_size * positions)


def emit(engine: str, schedule: Schedule, batch_size: int = 1) -> str:
    """The schedule in ``engine``'s syntax. vLLM: a ``--speculative-config`` JSON whose
    ``num_speculative_tokens_per_batch_size`` rows are [largest batch size, draft length]; TensorRT-LLM:
    YAML for the LLM API's speculative config; SGLang (no schedule): server flags for ``batch_size``."""
    gammas = dict(schedule)
    if engine == "vllm":
        return json.dumps({"num_speculative_tokens": gammas[min(gammas)],
                           "num_speculative_tokens_per_batch_size": [[b, g] for b, g in schedule]})
    if engine == "trtllm":
        rows = "".join(f"    {b}: {g}\n" for b, g in schedule)
        return f"speculative_config:\n  max_draft_len: {max(gammas.values())}\n  draft_len_schedule:\n{rows}".rstrip()
    if engine == "sglang":
        gamma = gammas[batch_size]
        if gamma == 0:
            return ""
        return f"--speculative-num-steps {gamma} --speculative-num-draft-tokens {gamma + 1} --speculative-eagle-topk 1"
    raise ValueError(f"unknown engine {engine!r}")
