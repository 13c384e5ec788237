"""engine_factory.py: ``build_engine`` picks the drafter and gamma policy a SpecConfig names, and refuses
up front what the pair cannot run, each with its message."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from verispec.config import SpecConfig
from verispec.engine_factory import ModelPair, build_engine
from verispec.errors import CheckpointError
from verispec.models.llama import LlamaConfig, LlamaForCausalLM
from verispec.models.protocol import Capabilities


def native_draft() -> LlamaForCausalLM:
    return LlamaForCausalLM(LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                                        num_attention_heads=2))


def pair(draft=None, draft_dir=None, target=None, **fields) -> ModelPair:
    target = target if target is not None else SimpleNamespace(config=SimpleNamespace(vocab_size=16),
                                                               capabilities=LlamaForCausalLM.capabilities)
    return ModelPair(target, draft, None, Path("target"), draft_dir, **fields)


@pytest.mark.parametrize("spec, message", [
    (SpecConfig(gamma=3), "--method chain needs a draft model; pass --draft DIR or use --no-spec"),
    (SpecConfig(method="tree"), "--method tree needs a draft model"),
    (SpecConfig(drafter="eagle"), "--method eagle needs a head; load the pair with need_eagle=True"),
])
def test_an_engine_without_what_its_method_drafts_with_is_refused(spec, message):
    with pytest.raises(CheckpointError) as caught:
        build_engine(pair(), spec)
    assert message in str(caught.value)


def test_a_draft_vocabulary_needs_the_native_draft():
    with pytest.raises(CheckpointError, match="--draft-vocab needs the native Llama-family draft model; pass "
                                              "--draft-vocab all"):
        build_engine(pair(draft=SimpleNamespace(capabilities=Capabilities(trees=True))), SpecConfig(draft_vocab=100))


def test_each_drafter_the_spec_names_is_built():
    from verispec.adaptive import AdaptiveGamma, FixedGamma
    from verispec.drafters import DraftModelDrafter, EarlyExitDrafter, NgramDrafter

    target = LlamaForCausalLM(LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=2,
                                          num_attention_heads=2))
    draft = native_draft()
    plain = build_engine(pair(target=target), SpecConfig(method="none"))
    assert plain.drafter is None
    ngram = build_engine(pair(target=target), SpecConfig(drafter="ngram", ngram_max=3, ngram_min=2))
    assert isinstance(ngram.drafter, NgramDrafter) and isinstance(ngram.gamma_policy, FixedGamma)
    early = build_engine(pair(target=target), SpecConfig(drafter="early_exit", exit_layer=1))
    assert isinstance(early.drafter, EarlyExitDrafter)
    model = build_engine(pair(draft, target=target), SpecConfig(draft_vocab=8, gamma_policy="adaptive"))
    assert isinstance(model.drafter, DraftModelDrafter) and model.drafter.vocab_limit == 8
    assert isinstance(model.gamma_policy, AdaptiveGamma)
    assert build_engine(pair(draft, target=target), SpecConfig(method="tree")).gamma_policy is None  # chains only


def test_a_method_the_models_cannot_run_is_refused_naming_the_model():
    from verispec.engine_factory import describe
    from verispec.models.compressed import CompressedForCausalLM

    assert describe(native_draft()) == "the LlamaForCausalLM model"
    no_trees = SimpleNamespace(config=SimpleNamespace(vocab_size=16), capabilities=Capabilities(),
                               tree_problem="its cache cannot hold branches")
    with pytest.raises(CheckpointError) as caught:
        build_engine(pair(target=no_trees), SpecConfig(method="tree"))
    assert str(caught.value) == ("the SimpleNamespace model cannot verify trees (its cache cannot hold branches); "
                                 "use --method chain")
    static_only = SimpleNamespace(capabilities=Capabilities(trees=True))  # no staged trees
    with pytest.raises(CheckpointError, match="dynamic trees feed tree levels through the draft, which the "
                                              "SimpleNamespace model cannot do; use a static shape"):
        build_engine(pair(static_only), SpecConfig(method="tree", tree="dynamic:8"))
    with pytest.raises(CheckpointError, match="the SimpleNamespace model cannot draft trees; use --method chain"):
        build_engine(pair(SimpleNamespace(capabilities=Capabilities())), SpecConfig(method="tree"))
    assert describe(CompressedForCausalLM.__new__(CompressedForCausalLM)) == "the compressed-attention model"


def test_row_drafter_lends_a_bridged_draft_to_each_row_and_nothing_else():
    from verispec.drafters.cross_vocab import CrossVocabDrafter
    from verispec.engine_factory import row_drafter

    chain, ngram = SpecConfig(gamma=3), SpecConfig(gamma=3, drafter="ngram")
    assert row_drafter(pair(native_draft()), chain) is None
    assert row_drafter(pair(native_draft(), bridge=object()), ngram) is None
    made = row_drafter(pair(native_draft(), bridge=object()), chain)
    assert isinstance(made(), CrossVocabDrafter) and made() is not made()
    with pytest.raises(CheckpointError, match="chains and static trees"):
        build_engine(pair(native_draft(), bridge=object()), SpecConfig(method="tree", tree="dynamic:6"))


@pytest.mark.parametrize("drafter", ["model", "eagle", "ngram", "early_exit"])
def test_the_adaptive_default_keeps_greedy_outputs_for_every_chain_drafter(drafter):
    """Chains in generate and serve run the adaptive policy by default: from cold it climbs through gamma
    0, 1, 2, ... (the drafter sits out rounds, then catches up), and the tokens stay plain decoding's."""
    from verispec.config import SamplingParams, StopRules
    from verispec.loading import load_pair

    tiny = load_pair("tiny", need_eagle=drafter == "eagle")
    engine = build_engine(tiny, SpecConfig(gamma=4, gamma_policy="adaptive", drafter=drafter, exit_layer=2))
    plain = build_engine(tiny, SpecConfig(method="none"))
    greedy, stop = SamplingParams(temperature=0), StopRules(max_tokens=40, ignore_eos=True)
    gammas = set()
    for prompt in (tiny.tokenizer.encode("def add(a, b):\n    return"), tiny.tokenizer.encode("The cat sat")):
        result = engine.generate(prompt, greedy, SpecConfig(gamma=4, gamma_policy="adaptive", drafter=drafter,
                                                            exit_layer=2), stop)
        assert result.tokens == plain.generate(prompt, greedy, SpecConfig(method="none"), stop).tokens
        gammas |= {record.drafted for record in result.stats.rounds}
    assert 0 in gammas and len(gammas) >= 2  # it switched between plain rounds and drafting ones
