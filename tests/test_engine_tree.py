"""Trees end to end: greedy tree spec == plain for every builder, KV state after compaction equals a
fresh prefill of the committed tokens, and sampled outputs follow the target in every sibling mode."""

from __future__ import annotations

import pytest

from test_engine import PROMPT, assert_cache_matches_fresh_prefill, plain
from test_engine_statistical import agreement, exact_target_distribution, tiny_pair  # noqa: F401 (fixture)
from verispec.config import SamplingParams, SpecConfig, StopRules, TreeShape
from verispec.drafters import DraftModelDrafter
from verispec.engine import SpecEngine
from verispec.errors import SamplingError
from verispec.models.llama import load_checkpoint

GREEDY = SamplingParams(temperature=0.0)
SHAPES = ["s4_k1_d5", "s3_k2_d6", "s2_k3_d7", "s5_k2_d9", "s3_k3_d10", "dynamic:4", "dynamic:8"]


@pytest.fixture(scope="module")
def models(checkpoints):
    return {name: load_checkpoint(path) for name, path in checkpoints.items()}


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("target_name,draft_name", [("llama", "draft"), ("qwen2", "draft_qwen2"), ("llama", "llama")])
def test_greedy_tree_equals_plain(models, shape, target_name, draft_name):
    target = models[target_name]
    engine = SpecEngine(target, DraftModelDrafter(models[draft_name]))
    result = engine.generate(PROMPT, GREEDY, SpecConfig(method="tree", tree=shape), StopRules(max_tokens=40))
    assert result.tokens == plain(target).tokens


def test_chain_shaped_tree_matches_chain_exactly(models):
    """s4_k1_d5 is the gamma-4 chain: same tokens and same committed tokens per round."""
    target, draft = models["llama"], models["draft"]
    chain = SpecEngine(target, DraftModelDrafter(draft)).generate(PROMPT, GREEDY, SpecConfig(gamma=4), StopRules(max_tokens=40))
    tree = SpecEngine(target, DraftModelDrafter(draft)).generate(
        PROMPT, GREEDY, SpecConfig(method="tree", tree="s4_k1_d5"), StopRules(max_tokens=40))
    assert [r.committed for r in tree.stats.rounds] == [r.committed for r in chain.stats.rounds]


def test_wider_trees_commit_more_with_a_perfect_draft(models):
    target = models["llama"]
    engine = SpecEngine(target, DraftModelDrafter(target))
    result = engine.generate(PROMPT, GREEDY, SpecConfig(method="tree", tree="s3_k2_d6"), StopRules(max_tokens=41))
    assert all(r.committed == 4 for r in result.stats.rounds[:-1])  # depth 3 fully accepted + bonus
    assert result.stats.summary()["tree_nodes"] == pytest.approx(5, abs=1)


@pytest.mark.parametrize("shape,mode,draft_name", [("s3_k2_d6", "deterministic", "llama"), ("s3_k3_d8", "iid", "draft"),
                                                   ("s3_k3_d8", "without_replacement", "draft"),
                                                   ("dynamic:8", "deterministic", "llama")])
def test_kv_state_follows_accepted_path(models, shape, mode, draft_name):
    """Sampling at temperature 1, so some paths are accepted and others rejected. Top-k (deterministic)
    children of an unrelated random draft are almost never accepted, so those cases draft with the
    target's own weights (still rejected often: a top-k child is accepted with probability p(x)). The
    dynamic tree learns those low rates and grows wide rather than deep, so deeper paths take longer."""
    target, draft = models["llama"], models[draft_name]
    drafter = DraftModelDrafter(draft)
    generation = SpecEngine(target, drafter).stream(
        PROMPT, SamplingParams(temperature=1.0), SpecConfig(method="tree", tree=shape, sibling_mode=mode),
        StopRules(max_tokens=500), seed=4)
    for count, _ in enumerate(generation):  # until some path below the root was accepted and compacted
        if count >= 15 and sum(r.accepted > 1 for r in generation.stats.rounds) >= 2 or count == 400:
            break
    assert sum(r.accepted > 1 for r in generation.stats.rounds) >= 2, "want accepted paths to compact"
    assert_cache_matches_fresh_prefill(target, generation.cache, generation.context[:-1])
    assert drafter.seen == generation.context[:len(drafter.seen)]
    assert_cache_matches_fresh_prefill(draft, drafter.cache, drafter.seen)


def test_tree_shape_validation():
    assert TreeShape.parse("s3_k2_d6") == TreeShape(3, 2, 6)
    assert TreeShape.parse("dynamic:8").dynamic
    for bad in ["s3_k2", "s3_k2_d3", "s2_k2_d9", "dynamic:1", "tree"]:
        with pytest.raises(SamplingError):
            TreeShape.parse(bad)
    with pytest.raises(SamplingError, match="deterministic"):
        SpecConfig(method="tree", tree="dynamic:6", sibling_mode="iid")


SAMPLES = 1500


@pytest.mark.parametrize("mode", ["iid", "without_replacement", "deterministic"])
def test_tree_samples_follow_target(tiny_pair, mode):  # noqa: F811
    target, draft = tiny_pair
    sampling = SamplingParams(temperature=0.9, top_k=3)
    expected = exact_target_distribution(target, sampling)
    engine = SpecEngine(target, DraftModelDrafter(draft))
    spec = SpecConfig(method="tree", tree="s2_k2_d4", sibling_mode=mode)
    counts: dict[tuple[int, ...], int] = {}
    for seed in range(SAMPLES):
        tokens = tuple(engine.generate([1, 2, 3, 0, 2], sampling, spec, StopRules(max_tokens=4), seed=seed).tokens)
        counts[tokens] = counts.get(tokens, 0) + 1
    p_value, tv, bound = agreement(expected, counts)
    assert p_value > 1e-4 and tv < bound, (p_value, tv, bound)


def test_dynamic_tree_learns_acceptance_and_goes_deep_with_a_perfect_draft(models):
    """Drafting with the target's own weights, every top-ranked child is accepted and no other: the
    calibration learns that, and the later dynamic trees spend their budget on depth (a chain of
    DYNAMIC_TREE_DEPTH drafts, all accepted, plus the bonus token)."""
    target = models["llama"]
    drafter = DraftModelDrafter(target)
    engine = SpecEngine(target, drafter)
    result = engine.generate(PROMPT, GREEDY, SpecConfig(method="tree", tree="dynamic:7"), StopRules(max_tokens=120))
    assert result.tokens == plain(target, max_tokens=120).tokens
    calibration = drafter.calibration
    assert calibration.observations() > 0
    assert all(accepted == reached for accepted, reached in zip(calibration.accepted[0], calibration.reached[0]))
    assert sum(calibration.accepted[1]) == 0 and sum(calibration.reached[1]) > 0
    depth = TreeShape.parse("dynamic:7").depth
    assert [r.committed for r in result.stats.rounds[-6:-1]] == [depth + 1] * 5


def test_dynamic_tree_calibration_observes_every_candidate_of_reached_nodes(models):
    """A round's observations: all candidates (kept or not) under each node of the accepted path."""
    target, draft = models["llama"], models["draft"]
    drafter = DraftModelDrafter(draft)
    engine = SpecEngine(target, drafter)
    result = engine.generate(PROMPT, GREEDY, SpecConfig(method="tree", tree="dynamic:5"), StopRules(max_tokens=30))
    rounds = result.stats.rounds[:-1]  # the last round is not committed to the drafter
    shape = TreeShape.parse("dynamic:5")
    # each committed round reached 1 + accepted nodes, each with `branching` candidates at most
    reached_nodes = sum(min(r.accepted + 1, shape.depth) for r in rounds)
    assert 0 < drafter.calibration.observations() <= shape.branching * reached_nodes
    assert drafter.calibration.observations() >= shape.branching * len(rounds)  # the root's, every round
