"""Self-speculation: early layers draft, the verify pass reuses their KV; lossless and cache-exact."""

from __future__ import annotations

import pytest

from test_engine import PROMPT, assert_cache_matches_fresh_prefill, plain
from test_engine_statistical import agreement, exact_target_distribution, tiny_pair  # noqa: F401 (fixture)
from verispec.config import SamplingParams, SpecConfig, StopRules
from verispec.drafters import EarlyExitDrafter
from verispec.engine import SpecEngine
from verispec.errors import VerispecError
from verispec.models.llama import load_checkpoint
from verispec.testing import make_checkpoint


@pytest.fixture(scope="module")
def deep_target(tmp_path_factory):
    return load_checkpoint(make_checkpoint(tmp_path_factory.mktemp("deep") / "t", 64, hidden=64, layers=4, seed=9))


def self_spec(gamma, exit_layer):
    return SpecConfig(method="chain", gamma=gamma, drafter="early_exit", exit_layer=exit_layer)


@pytest.mark.parametrize("exit_layer", [1, 2, 3])
@pytest.mark.parametrize("gamma", [1, 3, 6])
def test_greedy_self_spec_equals_plain(deep_target, exit_layer, gamma):
    engine = SpecEngine(deep_target, EarlyExitDrafter(deep_target, exit_layer))
    result = engine.generate(PROMPT, SamplingParams(temperature=0), self_spec(gamma, exit_layer), StopRules(max_tokens=40))
    assert result.tokens == plain(deep_target).tokens


@pytest.mark.parametrize("sampling", [SamplingParams(temperature=0), SamplingParams(temperature=1.0)])
def test_cache_equals_fresh_prefill_after_reused_rounds(deep_target, sampling):
    """The early-layer KV written while drafting, reused by verification and partly rejected, leaves
    exactly the committed prefix behind."""
    engine = SpecEngine(deep_target, EarlyExitDrafter(deep_target, 2))
    generation = engine.stream(PROMPT, sampling, self_spec(4, 2), StopRules(max_tokens=200), seed=2)
    for count, _ in enumerate(generation):
        if count == 15:
            break
    assert any(r.accepted < r.drafted for r in generation.stats.rounds)
    assert_cache_matches_fresh_prefill(deep_target, generation.cache, generation.context[:-1])


def test_exit_layer_must_be_inside_the_model(deep_target):
    with pytest.raises(VerispecError, match="exit-layer"):
        EarlyExitDrafter(deep_target, 4)
    with pytest.raises(VerispecError):
        SpecConfig(method="tree", drafter="early_exit")


def test_sampled_self_spec_follows_target(tiny_pair):  # noqa: F811
    target, _ = tiny_pair
    sampling = SamplingParams(temperature=1.0, top_p=0.9)
    expected = exact_target_distribution(target, sampling)
    engine = SpecEngine(target, EarlyExitDrafter(target, 1))
    counts = {}
    for seed in range(1500):
        tokens = tuple(engine.generate([1, 2, 3, 0, 2], sampling, self_spec(2, 1), StopRules(max_tokens=4), seed=seed).tokens)
        counts[tokens] = counts.get(tokens, 0) + 1
    p_value, tv, bound = agreement(expected, counts)
    assert p_value > 1e-4 and tv < bound, (p_value, tv, bound)
