"""verispec.bench.offline: the native runner records failed requests instead of dropping them."""

from __future__ import annotations

from verispec.bench.config import BenchConfig, parse_variant
from verispec.bench.offline import Job, NativeRunner
from verispec.bench.records import summarize
from verispec.bench.workloads import BenchPrompt
from verispec.config import SamplingParams, StopRules


def test_failed_request_is_recorded_not_dropped(byte_pair):
    from verispec.loading import load_pair

    pair = load_pair(*byte_pair)
    variant = parse_variant("chain", BenchConfig().spec)
    runner = NativeRunner(pair, variant, SamplingParams(temperature=0), 60.0, lambda ids: "")
    good = BenchPrompt("p0", "chat", "hi", "raw", (5, 6, 7), 4)
    too_long = BenchPrompt("p1", "chat", "x", "raw", tuple([5] * 600), 4)  # beyond the 512-token context
    jobs = [Job(p, StopRules(max_tokens=4), 0, 0, "c1") for p in (good, too_long)]
    for concurrency in (1, 2):
        records = runner.run(jobs, concurrency)
        assert [r.status for r in records] == ["ok", "error"] and "context" in records[1].error
        s = summarize(records, 1.0)
        assert s["requests"] == 2 and s["error_rate"] == 0.5 and s["quality"]["chat"]["failed"] == 0.5


def test_a_target_that_does_not_batch_runs_at_concurrency_above_one(byte_pair):
    from verispec.loading import load_pair

    pair = load_pair(*byte_pair, backend="hf")  # one sequence per cache: rows run one after another
    assert not pair.target.capabilities.batching
    runner = NativeRunner(pair, parse_variant("chain", BenchConfig().spec), SamplingParams(temperature=0), 60.0,
                          lambda ids: "")
    prompts = [BenchPrompt(f"p{i}", "chat", "hi", "raw", tuple(ids), 6) for i, ids in enumerate([(5, 6, 7), (9, 8)])]
    jobs = [Job(p, StopRules(max_tokens=6, ignore_eos=True), 0, 0, "c") for p in prompts]
    alone, together = runner.run(jobs, 1), runner.run(jobs, 2)
    assert [r.status for r in together] == ["ok", "ok"]
    assert [r.output_tokens for r in together] == [6, 6]
    assert [r.tokens for r in together] == [r.tokens for r in alone] and together[0].tokens is not None
