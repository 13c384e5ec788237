"""stats.py: per-request metrics from hand-made round records (counts, per-position acceptance, time
split, summary), the percentile, and the confidence intervals of the median and of a ratio."""

from __future__ import annotations

import random

import numpy as np
import pytest

from verispec.stats import (ACCEPTANCE_RATE_DEFINITION, RequestStats, RoundRecord, median_interval, percentile,
                            ratio_interval)

SUMMARY_KEYS = {
    "prompt_tokens", "generated_tokens", "finish_reason", "rounds", "drafted", "accepted", "committed_per_round",
    "acceptance_rate", "acceptance_rate_definition", "per_position_acceptance", "acceptance_histogram", "tree_nodes",
    "ttft_ms", "e2e_ms", "tokens_per_s", "decode_tokens_per_s", "time_split", "median_itl_ms", "p95_itl_ms",
    "median_chunk_gap_ms", "p95_chunk_gap_ms",
}


def four_rounds() -> RequestStats:
    """Gamma 4 fully accepted, gamma 4 with one accepted, gamma 2 with none (cut by a stop), a plain round."""
    rounds = [RoundRecord(4, 4, 5, "bonus", draft_s=0.010, draft_read_s=0.002, verify_s=0.020, state_s=0.003,
                          refresh_s=0.001, other_s=0.001, tree_nodes=4),
              RoundRecord(4, 1, 2, "recovered", verify_s=0.010, tree_nodes=4),
              RoundRecord(2, 0, 1, "cut", tree_nodes=2),
              RoundRecord(0, 0, 1, "bonus")]
    return RequestStats(prompt_tokens=7, generated_tokens=9, rounds=rounds, prefill_s=0.05, ttft_s=0.1, e2e_s=0.5,
                        token_gaps_s=[0.01, 0.0, 0.0, 0.02, 0.03], chunk_gaps_s=[0.01, 0.02],
                        finish_reason="stop")


def test_counts_and_rates_over_the_rounds():
    stats = four_rounds()
    assert (stats.drafted, stats.accepted) == (10, 5)
    assert stats.acceptance_rate == 0.5 and stats.committed_per_round == 9 / 4
    assert stats.rounds[0].total_s == pytest.approx(0.034)  # draft + verify + state + other


def test_per_position_acceptance_is_unconditional_and_conditional():
    # Position 2: proposed by 3 rounds, reached (first accepted) by 2, accepted by 1.
    got = four_rounds().per_position_acceptance()
    assert got["unconditional"] == pytest.approx([2 / 3, 1 / 3, 1 / 2, 1 / 2])
    assert got["conditional"] == pytest.approx([2 / 3, 1 / 2, 1.0, 1.0])


def test_histogram_counts_rounds_by_accepted_drafts():
    assert four_rounds().acceptance_histogram() == [2, 1, 0, 0, 1]


def test_time_split_is_in_milliseconds_per_phase():
    assert four_rounds().time_split() == pytest.approx(
        {"prefill_ms": 50.0, "draft_ms": 10.0, "verify_ms": 30.0, "state_ms": 3.0, "refresh_ms": 1.0, "other_ms": 1.0})


def test_throughput_counts_prefill_once_and_decoding_after_the_first_token():
    stats = four_rounds()
    assert stats.tokens_per_s == pytest.approx(9 / 0.5)
    assert stats.decode_tokens_per_s == pytest.approx(8 / 0.4)
    assert RequestStats(generated_tokens=3).tokens_per_s == 0.0  # no time measured: 0, not a division error
    assert RequestStats(generated_tokens=3, ttft_s=0.2, e2e_s=0.2).decode_tokens_per_s == 0.0


def test_summary_has_every_key_with_values_from_the_records():
    summary = four_rounds().summary()
    assert set(summary) == SUMMARY_KEYS
    assert (summary["rounds"], summary["drafted"], summary["accepted"], summary["finish_reason"]) == (4, 10, 5, "stop")
    assert summary["acceptance_rate_definition"] == ACCEPTANCE_RATE_DEFINITION
    assert summary["tree_nodes"] == pytest.approx(10 / 4)  # mean verified nodes per round
    assert (summary["ttft_ms"], summary["e2e_ms"]) == pytest.approx((100.0, 500.0))
    # Gaps sorted: 0, 0, 10, 20, 30 ms: median 10; p95 at rank 3.8 interpolates 20 -> 30.
    assert (summary["median_itl_ms"], summary["p95_itl_ms"]) == pytest.approx((10.0, 28.0))
    assert (summary["median_chunk_gap_ms"], summary["p95_chunk_gap_ms"]) == pytest.approx((15.0, 19.5))


def test_an_empty_request_summarises_to_zeros():
    summary = RequestStats().summary()
    assert set(summary) == SUMMARY_KEYS
    assert summary["rounds"] == summary["drafted"] == summary["committed_per_round"] == summary["acceptance_rate"] == 0
    assert summary["per_position_acceptance"] == {"unconditional": [], "conditional": []}
    assert summary["acceptance_histogram"] == [0] and summary["tree_nodes"] == 0.0 and summary["median_itl_ms"] == 0.0


def test_rounds_as_dicts_keeps_every_field():
    first = four_rounds().rounds_as_dicts()[0]
    assert first["drafted"] == 4 and first["last_kind"] == "bonus" and first["draft_read_s"] == 0.002
    assert set(first) == set(RoundRecord.__dataclass_fields__)


def test_percentile_interpolates_linearly_between_order_statistics():
    assert percentile([], 50) == 0.0
    assert percentile([7.0], 95) == 7.0
    values = [4.0, 1.0, 3.0, 2.0]  # order does not matter
    assert [percentile(values, q) for q in (0, 50, 95, 100)] == pytest.approx([1.0, 2.5, 3.85, 4.0])
    rng = random.Random(0)
    sample = [rng.random() for _ in range(37)]
    for q in (1, 25, 50, 90, 99):
        assert percentile(sample, q) == pytest.approx(float(np.percentile(sample, q)))


def test_median_interval_at_another_level():
    # n = 3: (min, max) covers 1 - 2/8 = 0.75, enough at 50% and short of 95%.
    assert median_interval([2.0, 9.0, 5.0], level=0.5) == (2.0, 9.0, pytest.approx(0.75))
    assert median_interval([2.0, 9.0, 5.0]) is None and median_interval([]) is None


def test_ratio_interval_pairs_must_match_and_empty_denominators_give_zero():
    with pytest.raises(ValueError):
        ratio_interval([1.0, 2.0], [2.0])
    assert ratio_interval([0.0, 0.0], [0.0, 0.0]) == (0.0, 0.0)
    assert ratio_interval([1.0, 3.0], [2.0, 4.0], seed=5) == ratio_interval([1.0, 3.0], [2.0, 4.0], seed=5)


def test_median_interval_uses_binomial_order_statistics():
    # n = 6: only (min, max) reaches 95%, coverage 1 - 2/64; n = 5 cannot (1 - 2/32 < 0.95).
    assert median_interval([3.0, 1.0, 2.0, 6.0, 5.0, 4.0]) == (1.0, 6.0, pytest.approx(1 - 2 / 64))
    assert median_interval([1.0, 2.0, 3.0, 4.0, 5.0]) is None
    # n = 16: P(Bin(16, 1/2) <= 3) = 697/65536 keeps 95%, adding P(= 4) = 1820/65536 does not.
    low, high, coverage = median_interval([float(v) for v in range(16, 0, -1)])
    assert (low, high) == (4.0, 13.0) and coverage == pytest.approx(1 - 2 * 697 / 65536)


def test_ratio_interval_resamples_prompts_and_covers_the_true_rate():
    assert ratio_interval([3.0], [4.0]) is None
    assert ratio_interval([2.0, 2.0, 2.0], [4.0, 4.0, 4.0]) == (0.5, 0.5)  # no spread, no width
    rng = random.Random(1)
    accepted = [float(sum(rng.random() < 0.7 for _ in range(4))) for _ in range(200)]
    low, high = ratio_interval(accepted, [4.0] * 200)
    assert ratio_interval(accepted, [4.0] * 200) == (low, high)  # seeded: the same call, the same interval
    assert low < sum(accepted) / 800 < high
    normal_width = 2 * 1.96 * (0.7 * 0.3 / 800) ** 0.5  # binomial proportion over 800 drafts
    assert 0.8 * normal_width < high - low < 1.2 * normal_width
    # Coverage: over 100 simulated prompt sets of uneven sizes, the 90% interval holds the true rate
    # 0.6 about 90 times (binomial sd 3; a wrong resampling unit would miss it far more often).
    hits = 0
    for trial in range(100):
        rng = random.Random(100 + trial)
        sizes = [rng.randint(1, 12) for _ in range(40)]
        hits_per_prompt = [float(sum(rng.random() < 0.6 for _ in range(n))) for n in sizes]
        low, high = ratio_interval(hits_per_prompt, [float(n) for n in sizes], level=0.9, resamples=300, seed=trial)
        hits += low <= 0.6 <= high
    assert 80 <= hits <= 98

