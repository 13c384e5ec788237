"""verispec.bench.serving: arrival schedules, chunk apportioning and load-point names (no server; the
end-to-end run against `verispec serve` is in tests/test_bench.py)."""

from __future__ import annotations

import math

import pytest

from verispec.bench.serving import apportion, arrival_offsets


def test_arrivals_and_chunk_apportioning():
    offsets = arrival_offsets(2000, rate=4.0, burstiness=1.0, seed=3)
    assert offsets[0] == 0 and offsets == arrival_offsets(2000, 4.0, 1.0, 3)  # seeded: same for every endpoint
    assert offsets[-1] / 1999 == pytest.approx(0.25, rel=0.1)  # mean gap 1 / rate
    assert arrival_offsets(3, math.inf, 1.0, 0) == [0.0, 0.0, 0.0]
    assert apportion([3, 1], 8) == [6, 2] and apportion([5], 2) == [2] and sum(apportion([1, 7, 2], 5)) == 5


def test_load_points_are_rates_then_concurrencies_with_stable_names():
    from verispec.bench.config import ServingSettings
    from verispec.bench.serving import LoadPoint, load_points

    points = load_points(ServingSettings(request_rates=(0.5, math.inf), max_concurrency=(1, 8)))
    assert [p.name for p in points] == ["rate=0.5", "rate=inf", "mc1", "mc8"]
    assert points[-1] == LoadPoint("concurrency", 8)
    assert apportion([1, 1, 1], 2) == [1, 1, 0]  # fewer tokens than chunks: no chunk floor
