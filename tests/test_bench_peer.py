"""verispec.bench.peer: the transformers peer's timing from streamed chunks, its generate arguments per
variant, and the errors it raises up front (no model is loaded: ``generate`` itself runs in the end-to-end
bench in tests/test_bench.py)."""

from __future__ import annotations

import pytest
import torch

from verispec.bench.config import BenchConfig, parse_variant
from verispec.bench.offline import Job
from verispec.bench.peer import ChunkTimes, PeerModels, PeerRunner, _fill_timing
from verispec.bench.workloads import BenchPrompt
from verispec.config import SamplingParams, StopRules
from verispec.errors import VerispecError

SETTINGS = {"prompt_lookup_num_tokens": 4, "max_matching_ngram_size": 3}
JOB = Job(BenchPrompt("p0", "chat", "hi", "raw", (5, 6, 7), 4), StopRules(max_tokens=4, eos_ids=(2, 3)), 0, 0, "c1")


def _runner(name: str, sampling=SamplingParams(temperature=0), draft=None) -> PeerRunner:
    variant = parse_variant(name, BenchConfig().spec)
    return PeerRunner(PeerModels(None, draft, SETTINGS), variant, sampling, 30.0, lambda ids: "")


def test_chunk_times_skip_the_prompt_and_record_chunk_sizes():
    streamer = ChunkTimes()
    streamer.put(torch.tensor([[5, 6, 7]]))  # transformers puts the prompt first
    streamer.put(torch.tensor([8]))
    streamer.put(torch.tensor([9, 10]))
    assert streamer.sizes == [1, 2] and len(streamer.times) == 2 and streamer.times[0] <= streamer.times[1]


def test_timing_counts_only_chunks_up_to_the_stop_cut():
    streamer = ChunkTimes()
    streamer.times, streamer.sizes = [10.5, 10.7, 11.0], [2, 3, 2]
    record = JOB.new_record("hf")
    _fill_timing(record, streamer, began=10.0, elapsed=1.2, kept=4)  # the cut falls inside the second chunk
    assert record.ttft_s == pytest.approx(0.5) and record.chunk_gaps_s == [pytest.approx(0.2)]
    assert record.token_gaps_s == [0.0, pytest.approx(0.2), 0.0]  # 2 tokens at once, then 2 more
    assert (record.output_tokens, record.committed, record.rounds, record.e2e_s) == (4, 4, 2, 1.2)


def test_generate_arguments_follow_the_variant_and_sampling():
    greedy = _runner("hf_prompt_lookup")._kwargs(JOB)
    assert greedy == dict(max_new_tokens=4, eos_token_id=[2, 3], pad_token_id=2, do_sample=False, max_time=30.0,
                          prompt_lookup_num_tokens=4, max_matching_ngram_size=3)
    draft = torch.nn.Linear(1, 1)
    sampled = _runner("hf_assisted", SamplingParams(temperature=0.7, top_k=5), draft)._kwargs(JOB)
    assert sampled["assistant_model"] is draft and sampled["do_sample"]
    assert (sampled["temperature"], sampled["top_k"], sampled["top_p"], sampled["min_p"]) == (0.7, 5, 1.0, None)


def test_peer_refuses_what_it_cannot_run():
    with pytest.raises(VerispecError, match="hf_assisted needs a draft model"):
        _runner("hf_assisted")
    with pytest.raises(VerispecError, match="one request at a time"):
        _runner("hf").run([JOB], concurrency=2)
