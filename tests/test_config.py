"""config.py: SamplingParams, StopRules, TreeShape and SpecConfig: defaults, derived values, and the
message each invalid value is refused with."""

from __future__ import annotations

import dataclasses
import math

import pytest

from verispec.config import DYNAMIC_TREE_DEPTH, DYNAMIC_TREE_TOPK, SamplingParams, SpecConfig, StopRules, TreeShape
from verispec.errors import SamplingError, VerispecError

# ---- SamplingParams ---------------------------------------------------------------------------------


def test_sampling_defaults_are_plain_sampling_with_every_filter_off():
    params = SamplingParams()
    assert (params.temperature, params.top_k, params.top_p, params.min_p) == (1.0, 0, 1.0, 0.0)
    assert not params.greedy and not params.penalized
    assert SamplingParams(temperature=0).greedy and not SamplingParams(temperature=1e-6).greedy


@pytest.mark.parametrize("params, penalized", [
    (dict(presence_penalty=0.5), True), (dict(frequency_penalty=-0.1), True), (dict(repetition_penalty=1.1), True),
    (dict(repetition_penalty=0.9), True), (dict(repetition_penalty=1.0), False), (dict(presence_penalty=0.0), False),
])
def test_penalized_means_any_penalty_away_from_its_off_value(params, penalized):
    assert SamplingParams(**params).penalized is penalized


@pytest.mark.parametrize("params, message", [
    (dict(temperature=-0.1), "temperature must be >= 0 and finite (0 = greedy), got -0.1"),
    (dict(temperature=math.inf), "temperature must be >= 0 and finite"),
    (dict(temperature=math.nan), "temperature must be >= 0 and finite"),
    (dict(top_k=-1), "top_k must be an integer >= 0 (0 = off), got -1"),
    (dict(top_k=2.5), "top_k must be an integer >= 0 (0 = off), got 2.5"),
    (dict(top_p=0.0), "top_p must be in (0, 1] (1 = off), got 0.0"),
    (dict(top_p=1.01), "top_p must be in (0, 1]"),
    (dict(min_p=-0.01), "min_p must be in [0, 1] (0 = off), got -0.01"),
    (dict(min_p=1.5), "min_p must be in [0, 1]"),
    (dict(presence_penalty=2.01), "presence_penalty must be in [-2, 2] (0 = off), got 2.01"),
    (dict(frequency_penalty=-3), "frequency_penalty must be in [-2, 2] (0 = off), got -3"),
    (dict(repetition_penalty=0.0), "repetition_penalty must be > 0 and finite (1 = off), got 0.0"),
    (dict(repetition_penalty=math.inf), "repetition_penalty must be > 0 and finite"),
])
def test_sampling_refuses_out_of_range_values_saying_which_and_why(params, message):
    with pytest.raises(SamplingError) as caught:
        SamplingParams(**params)
    assert message in str(caught.value)
    assert isinstance(caught.value, VerispecError)  # a user error: the CLI exits 2, the server answers 400


def test_sampling_accepts_the_edges_of_every_range():
    SamplingParams(temperature=0, top_k=0, top_p=1.0, min_p=0.0)
    SamplingParams(top_p=1e-9, min_p=1.0, presence_penalty=-2, frequency_penalty=2, repetition_penalty=1e-9)


def test_a_guide_takes_no_part_in_comparing_or_hashing():
    guided = SamplingParams(temperature=0.7, guide=object())
    assert guided == SamplingParams(temperature=0.7) and hash(guided) == hash(SamplingParams(temperature=0.7))
    assert "guide" not in repr(guided)
    assert SamplingParams(temperature=0.7) != SamplingParams(temperature=0.8)


def test_configs_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        SamplingParams().temperature = 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        SpecConfig().gamma = 2


# ---- StopRules ------------------------------------------------------------------------------------


def test_stop_rules_need_at_least_one_token():
    assert StopRules().max_tokens == 64 and StopRules(max_tokens=1).max_tokens == 1
    with pytest.raises(SamplingError, match=r"max_tokens must be >= 1, got 0"):
        StopRules(max_tokens=0)


# ---- TreeShape ------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, shape, drafts, positions", [
    ("s3_k2_d6", TreeShape(3, 2, 6), 5, 6),
    ("s4_k1_d5", TreeShape(4, 1, 5), 4, 5),  # the chain with gamma 4
    ("s3_k2_d4", TreeShape(3, 2, 4), 3, 4),  # smallest budget: the main path alone
    ("s3_k2_d7", TreeShape(3, 2, 7), 6, 7),  # largest: every level full
    ("s10_k3_d12", TreeShape(10, 3, 12), 11, 12),
])
def test_static_shapes_parse_with_their_draft_and_cache_counts(text, shape, drafts, positions):
    parsed = TreeShape.parse(text)
    assert parsed == shape and not parsed.dynamic
    assert parsed.num_drafts == drafts and parsed.cache_positions == positions


@pytest.mark.parametrize("text, depth, positions", [
    ("dynamic:2", 1, 2),  # one draft: depth 1, nothing staged beyond the root level
    ("dynamic:3", 2, 5),  # depth 2 stages K = 4 nodes in the draft's cache, more than its 2 drafts
    ("dynamic:8", DYNAMIC_TREE_DEPTH, 21),  # 4 x 5 staged
    ("dynamic:65", DYNAMIC_TREE_DEPTH, 65),  # 64 drafts outnumber the staged levels
])
def test_dynamic_shapes_cap_the_depth_and_count_staged_levels(text, depth, positions):
    shape = TreeShape.parse(text)
    assert shape.dynamic and shape.depth == depth and shape.branching == DYNAMIC_TREE_TOPK
    assert shape.num_drafts == shape.budget - 1 and shape.cache_positions == positions


@pytest.mark.parametrize("text, message", [
    ("s3_k2_d8", "tree 's3_k2_d8': need depth >= 1, branching >= 1 and depth + 1 <= D <= depth * branching + 1"),
    ("s3_k2_d3", "need depth >= 1"),
    ("s0_k2_d1", "need depth >= 1"),
    ("s2_k0_d3", "need depth >= 1"),
    ("dynamic:1", "tree 'dynamic:1': the budget D must be in 2..65"),
    ("dynamic:66", "the budget D must be in 2..65"),
    ("s3-k2-d6", "cannot parse tree shape 's3-k2-d6'; use sN_kK_dD (e.g. s3_k2_d6) or dynamic:D"),
    ("dynamic", "cannot parse tree shape"),
    ("", "cannot parse tree shape"),
])
def test_impossible_tree_shapes_are_refused(text, message):
    with pytest.raises(SamplingError) as caught:
        TreeShape.parse(text)
    assert message in str(caught.value)


# ---- SpecConfig -----------------------------------------------------------------------------------


def test_spec_defaults_and_drafts_per_round():
    spec = SpecConfig()
    assert (spec.method, spec.gamma, spec.gamma_policy, spec.drafter, spec.sibling_mode) == \
        ("chain", 4, "fixed", "model", "deterministic")
    assert spec.enabled and spec.max_drafts == 4
    assert SpecConfig(gamma=64).max_drafts == 64
    assert SpecConfig(method="tree").max_drafts == 5 and SpecConfig(method="tree").tree_shape == TreeShape(3, 2, 6)
    assert SpecConfig(method="tree", tree="dynamic:9").max_drafts == 8
    off = SpecConfig(method="none", gamma=0)  # gamma is only checked for chains
    assert not off.enabled and off.max_drafts == 0


def test_extra_takes_no_part_in_comparing():
    assert SpecConfig(extra={"note": 1}) == SpecConfig()


@pytest.mark.parametrize("params, message", [
    (dict(method="beam"), "unknown method 'beam'; choose one of none, chain, tree"),
    (dict(gamma=0), "gamma must be in 1..64, got 0"),
    (dict(gamma=65), "gamma must be in 1..64, got 65"),
    (dict(sibling_mode="random"),
     "unknown sibling mode 'random'; choose one of iid, without_replacement, deterministic"),
    (dict(gamma_policy="smart"), "unknown gamma policy 'smart'; choose one of fixed, adaptive, hf"),
    (dict(drafter="oracle"), "unknown drafter 'oracle'; choose one of model, ngram, early_exit, eagle"),
    (dict(draft_vocab=0), "draft_vocab must be >= 1 (or None for the whole vocabulary), got 0"),
    (dict(ngram_min=0), "need 1 <= ngram_min <= ngram_max, got 0, 4"),
    (dict(ngram_min=3, ngram_max=2), "need 1 <= ngram_min <= ngram_max, got 3, 2"),
    (dict(method="tree", drafter="early_exit"), "self-speculation (early exit) drafts chains only; drop --tree"),
    (dict(method="tree", tree="s1_k1_d9"), "tree 's1_k1_d9': need depth >= 1"),
    (dict(method="tree", tree="dynamic:8", sibling_mode="iid"),
     "dynamic trees keep the top-scoring nodes, which only the deterministic sibling mode verifies losslessly"),
])
def test_spec_refuses_impossible_settings(params, message):
    with pytest.raises(SamplingError) as caught:
        SpecConfig(**params)
    assert message in str(caught.value)


def test_the_tree_string_is_checked_only_for_tree_methods():
    assert SpecConfig(tree="nonsense").max_drafts == 4
    assert SpecConfig(method="tree", tree="dynamic:8").tree_shape.dynamic  # deterministic: allowed
    assert SpecConfig(method="tree", tree="s2_k2_d4", sibling_mode="iid").max_drafts == 3
