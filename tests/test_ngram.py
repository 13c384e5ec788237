"""N-gram (prompt lookup) drafting: lookup rules, greedy equality, and sampled outputs follow the target."""

from __future__ import annotations

import pytest

from test_engine import plain
from test_engine_statistical import agreement, exact_target_distribution, tiny_pair  # noqa: F401 (fixture)
from verispec.config import SamplingParams, SpecConfig, StopRules, TreeShape
from verispec.drafters import NgramDrafter
from verispec.engine import SpecEngine
from verispec.models.llama import load_checkpoint


def test_lookup_prefers_longest_then_most_recent_match():
    drafter = NgramDrafter(max_n=3, min_n=1)
    assert drafter.lookup([1, 2, 3, 4, 9, 2, 3, 5, 1, 2, 3], 2) == [4, 9]  # 3-gram [1,2,3] beats [2,3]
    assert drafter.lookup([7, 1, 8, 1, 9, 1], 1) == [9]  # most recent earlier occurrence of [1]
    assert drafter.lookup([1, 2, 3], 4) == []  # no earlier occurrence
    assert NgramDrafter(max_n=2, min_n=2).lookup([5, 1, 9, 1], 3) == []  # [9, 1] never seen before


def test_tree_merges_distinct_continuations_into_a_trie():
    drafter = NgramDrafter()
    context = [1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3, 5, 1, 2, 3]
    tree = drafter.propose_tree(context, TreeShape(3, 3, 7), "deterministic", None, None).tree
    buffers = tree.compile()
    siblings = [[tree.tokens[c] for c in kids] for kids in buffers.children]
    assert all(len(set(s)) == len(s) for s in siblings)  # siblings are distinct tokens
    assert [tree.tokens[c] for c in buffers.children[0]] == [5, 7]  # most recent continuations first
    assert tree.num_nodes <= 6 and max(buffers.depths.tolist()) <= 3


@pytest.fixture(scope="module")
def target(checkpoints):
    return load_checkpoint(checkpoints["llama"])


REPETITIVE = [3, 14, 15, 9, 26, 5, 3, 14, 15, 9, 26, 5, 3, 14]


@pytest.mark.parametrize("spec", [SpecConfig(method="chain", gamma=4, drafter="ngram"),
                                  SpecConfig(method="chain", gamma=2, drafter="ngram", ngram_max=2),
                                  SpecConfig(method="tree", tree="s3_k2_d6", drafter="ngram"),
                                  SpecConfig(method="tree", tree="s4_k3_d9", drafter="ngram")])
def test_greedy_ngram_equals_plain(target, spec):
    result = SpecEngine(target, NgramDrafter(spec.ngram_max, spec.ngram_min)).generate(
        REPETITIVE, SamplingParams(temperature=0), spec, StopRules(max_tokens=60))
    assert result.tokens == plain(target, REPETITIVE, max_tokens=60).tokens
    assert result.stats.drafted > 0


@pytest.mark.parametrize("method", ["chain", "tree"])
def test_sampled_ngram_follows_target(tiny_pair, method):  # noqa: F811
    target, _ = tiny_pair
    sampling = SamplingParams(temperature=1.0)
    expected = exact_target_distribution(target, sampling)
    spec = SpecConfig(method=method, gamma=2, tree="s2_k2_d4", drafter="ngram")
    engine = SpecEngine(target, NgramDrafter())
    counts, drafted = {}, 0
    for seed in range(1500):
        result = engine.generate([1, 2, 3, 0, 2], sampling, spec, StopRules(max_tokens=4), seed=seed)
        counts[tuple(result.tokens)] = counts.get(tuple(result.tokens), 0) + 1
        drafted += result.stats.drafted
    assert drafted > 1000  # the lookup really proposed drafts
    p_value, tv, bound = agreement(expected, counts)
    assert p_value > 1e-4 and tv < bound, (p_value, tv, bound)
