"""audit_endpoint_sampling.py: the endpoint audit's seed streams and how samples are drawn and counted
(``collect``, ``sample_prompts`` over a local sampler), without a server."""

from __future__ import annotations

import threading
from collections import Counter

import pytest

from verispec.audit import sample_seeds
from verispec.audit_endpoint_sampling import (REFERENCE_STREAM, SEED_MODULUS, audit_seeds, collect,
                                              sample_prompts)
from verispec.config import SamplingParams


def test_the_endpoint_and_the_reference_draw_from_independent_seed_streams():
    mine, theirs = audit_seeds(5, 0, 100), audit_seeds(5, 0, 100, reference=True)
    assert mine == audit_seeds(5, 0, 100) and len(set(mine)) == 100  # reproducible, no repeats
    assert not set(mine) & set(theirs)
    assert not set(mine) & set(audit_seeds(5, 1, 100))  # each prompt its own stream
    assert mine == [s % SEED_MODULUS for s in sample_seeds(5, 0, 100)]
    assert theirs == [s % SEED_MODULUS for s in sample_seeds(5, REFERENCE_STREAM, 100)]
    assert all(0 <= s < SEED_MODULUS for s in mine + theirs)


def test_collect_asks_in_groups_of_choices_and_counts_texts_and_finish_reasons():
    groups, lock = [], threading.Lock()

    def sampler(seeds):
        with lock:
            groups.append(list(seeds))
        return [(f"t{seed % 3}", "length" if seed % 2 else None) for seed in seeds]

    advanced = []
    texts, finish = collect(sampler, list(range(10)), choices=4, concurrency=2, advance=advanced.append)
    assert sorted(groups) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert texts == Counter({"t0": 4, "t1": 3, "t2": 3})
    assert finish == Counter({"length": 5, "None": 5})  # a missing finish reason is counted as "None"
    assert sorted(advanced) == [2, 4, 4]


def test_a_failed_request_fails_the_collection():
    def sampler(seeds):
        if 4 in seeds:
            raise RuntimeError("HTTP 500")
        return [("x", "length")] * len(seeds)

    with pytest.raises(RuntimeError, match="HTTP 500"):
        collect(sampler, list(range(12)), choices=2, concurrency=1)


def test_sample_prompts_from_a_local_source_uses_each_prompts_seeds():
    seen = {}

    def source(prompt):
        def run(seeds):
            seen.setdefault(prompt, []).extend(seeds)
            return [(prompt + "!", "length")] * len(seeds)
        return run

    out = sample_prompts(source, ["a", "b"], SamplingParams(), tokens=3, samples=70, seed=9, reference=True)
    assert out == [(Counter({"a!": 70}), Counter({"length": 70})), (Counter({"b!": 70}), Counter({"length": 70}))]
    assert seen == {"a": audit_seeds(9, 0, 70, reference=True), "b": audit_seeds(9, 1, 70, reference=True)}
