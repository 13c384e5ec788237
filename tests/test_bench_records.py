"""verispec.bench.records: per-request records, their summary metrics and the paired comparisons,
checked against values computed by hand."""

from __future__ import annotations

import pytest

from verispec.bench.records import RequestRecord, compare, mark_identical, record_from_stats, summarize
from verispec.stats import RequestStats, RoundRecord


def _record(variant="v", status="ok", tokens=0, ttft=None, e2e=None, gaps=(), repeat=0, prompt="p0", **kw):
    return RequestRecord(variant=variant, load="c1", repeat=repeat, prompt_id=prompt, task=kw.pop("task", "chat"),
                         prompt_tokens=5, max_tokens=16, status=status, finish_reason=kw.pop("finish", "length"),
                         output_tokens=tokens, ttft_s=ttft, e2e_s=e2e, token_gaps_s=list(gaps), **kw)


def test_summary_matches_hand_computed_values():
    records = [
        _record(tokens=10, ttft=0.1, e2e=1.0, gaps=[0.2, 0.0, 0.4], chunk_gaps_s=[0.2, 0.4], rounds=4, drafted=8,
                accepted=6, committed=9, tree_nodes=8, position_proposed=[4, 4], position_reached=[4, 3],
                position_accepted=[3, 3], histogram=[1, 0, 3], time_split_s={"draft": 0.2, "verify": 0.4}),
        _record(tokens=6, ttft=0.3, e2e=2.0, gaps=[0.6], chunk_gaps_s=[0.6], rounds=2, drafted=4, accepted=1,
                committed=5, tree_nodes=4, position_proposed=[2, 2], position_reached=[2, 1],
                position_accepted=[1, 0], histogram=[1, 1, 0], time_split_s={"draft": 0.1, "verify": 0.2}),
        _record(status="error", finish="error", e2e=0.5, error="boom"),
    ]
    s = summarize(records, wall_s=4.0)
    assert (s["requests"], s["ok"], s["errors"]) == (3, 2, 1)
    assert s["error_rate"] == pytest.approx(1 / 3)  # the failed request stays in the denominator
    assert s["tokens_per_s"] == pytest.approx(16 / 4.0) and s["requests_per_s"] == pytest.approx(2 / 4.0)
    ttft = s["latency_ms"]["ttft"]
    assert ttft["median"] == pytest.approx(200) and ttft["p95"] == pytest.approx(100 + 0.95 * 200)
    itl = s["latency_ms"]["itl"]  # pooled [0, 0.2, 0.4, 0.6]: linear interpolation, numpy's default
    assert itl["median"] == pytest.approx(300) and itl["p95"] == pytest.approx(400 + 0.85 * 200)
    assert s["latency_ms"]["e2e"]["n"] == 2  # latency over ok requests only
    tpot = s["latency_ms"]["tpot"]  # (1.0 - 0.1) / 9 = 100 ms and (2.0 - 0.3) / 5 = 340 ms per token
    assert tpot["n"] == 2 and tpot["median"] == pytest.approx(220)
    acc = s["acceptance"]
    assert acc["acceptance_rate"] == pytest.approx(7 / 12) and acc["committed_per_round"] == pytest.approx(14 / 6)
    assert acc["tree_nodes_per_round"] == pytest.approx(2.0)
    assert acc["per_position_unconditional"] == pytest.approx([4 / 6, 3 / 6])
    assert acc["per_position_conditional"] == pytest.approx([4 / 6, 3 / 4])
    assert acc["histogram"] == [2, 1, 3]
    assert s["time_split_ms"]["per_round"]["verify"] == pytest.approx(600 / 6)


def test_record_from_stats_agrees_with_stats_summary():
    rounds = [RoundRecord(4, 4, 5, "bonus", 0.01, 0.02, 0.001, tree_nodes=4),
              RoundRecord(4, 1, 2, "recovered", tree_nodes=4), RoundRecord(2, 0, 1, "cut", tree_nodes=2)]
    stats = RequestStats(prompt_tokens=3, generated_tokens=9, rounds=rounds, ttft_s=0.1, e2e_s=0.5,
                         token_gaps_s=[0.1, 0.2, 0.0, 0.0], chunk_gaps_s=[0.2])
    record = record_from_stats(_record(), stats)
    pooled = summarize([record], 1.0)["acceptance"]
    expected = stats.summary()
    assert pooled["acceptance_rate"] == pytest.approx(expected["acceptance_rate"])
    assert pooled["committed_per_round"] == pytest.approx(expected["committed_per_round"])
    assert pooled["per_position_conditional"] == pytest.approx(expected["per_position_acceptance"]["conditional"])
    assert pooled["per_position_unconditional"] == pytest.approx(expected["per_position_acceptance"]["unconditional"])
    assert pooled["histogram"] == expected["acceptance_histogram"]
    assert record.token_gaps_s == [0.2, 0.0, 0.0]  # the TTFT is not an inter-token gap


def test_speedups_pair_repeats_and_prompts():
    records = [_record("off", tokens=10, e2e=1.0, repeat=0), _record("off", tokens=10, e2e=1.0, repeat=1),
               _record("fast", tokens=10, e2e=0.5, repeat=0), _record("fast", tokens=10, e2e=0.25, repeat=1)]
    walls = {("off", "c1", 0): 1.0, ("off", "c1", 1): 1.0, ("fast", "c1", 0): 0.5, ("fast", "c1", 1): 0.25}
    rows = {r["variant"]: r for r in compare(records, walls, ("off",))}
    assert rows["fast"]["speedup_vs"]["off"] == pytest.approx(3.0)  # median of 2x and 4x
    assert rows["fast"]["per_prompt_speedup_vs"]["off"] == pytest.approx(3.0)
    assert rows["fast"]["tokens_per_s"] == pytest.approx(30.0) and rows["fast"]["tokens_per_s_range"] == [20.0, 40.0]
    assert rows["off"]["speedup_vs"] == {}


def test_speedup_interval_comes_from_paired_repeat_ratios():
    ratios = [0.9, 1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6]  # fast / off per repeat
    records, walls = [], {}
    for k, ratio in enumerate(ratios):
        records += [_record("off", tokens=10, e2e=1.0, repeat=k), _record("fast", tokens=10, e2e=1.0, repeat=k)]
        walls[("off", "c1", k)], walls[("fast", "c1", k)] = 1.0, 1.0 / ratio
    rows = {r["variant"]: r for r in compare(records, walls, ("off",))}
    interval = rows["fast"]["speedup_interval_vs"]["off"]
    # n = 8: k = 2 covers 1 - 2 * 9/256 = 0.93 < 0.95, so k = 1: (min, max) with 1 - 2/256.
    assert (interval["low"], interval["high"], interval["repeats"]) == (pytest.approx(0.9), pytest.approx(1.6), 8)
    assert interval["coverage"] == pytest.approx(1 - 2 / 256)
    assert rows["fast"]["speedup_vs"]["off"] == pytest.approx(1.25)
    few = compare(records[:4], {k: v for k, v in walls.items() if k[2] < 2}, ("off",))
    assert all(r["speedup_interval_vs"] == {} for r in few)  # two repeats give no interval, and none is shown


def test_identity_compares_same_prompt_and_repeat():
    records = [_record("off", tokens=2), _record("a", tokens=2), _record("b", tokens=2)]
    records[0].tokens, records[1].tokens, records[2].tokens = [1, 2], [1, 2], [1, 3]
    mark_identical(records, "off")
    assert [r.identical_to_baseline for r in records] == [None, True, False]
