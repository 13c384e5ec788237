"""The default pair, SmolLM2-135M-Instruct with its shipped draft: greedy speculation equals plain decoding
token for token for every method, alone and batched, and the README's main command runs on it."""

from __future__ import annotations

import dataclasses
import json

import pytest

from verispec.config import SamplingParams, SpecConfig, StopRules
from verispec.errors import CheckpointError
from verispec.loading import (SMOLLM2_DRAFT, build_engine, encode_prompt, eos_ids, load_pair, resolve_draft_vocab,
                              smollm2_path)

GREEDY = SamplingParams(temperature=0)
METHODS = {
    "chain g4": SpecConfig(method="chain", gamma=4),
    "chain g7": SpecConfig(method="chain", gamma=7),
    "tree s3_k2_d6": SpecConfig(method="tree", tree="s3_k2_d6"),
    "tree dynamic:8": SpecConfig(method="tree", tree="dynamic:8"),
    "ngram": SpecConfig(method="chain", gamma=4, drafter="ngram"),
    "self exit 6": SpecConfig(method="chain", gamma=3, drafter="early_exit", exit_layer=6),
}


@pytest.fixture(scope="module")
def pair():
    try:
        smollm2_path()
    except CheckpointError as err:  # `make setup` installs it; a bare library install may lack it
        pytest.skip(str(err))
    assert (SMOLLM2_DRAFT / "config.json").is_file(), "the SmolLM2 draft is shipped in the package"
    return load_pair("smollm2")


@pytest.fixture(scope="module")
def prompts(pair):
    chat = encode_prompt(pair.tokenizer, "Write a haiku about the sea.", chat=True)
    code = encode_prompt(pair.tokenizer, "def merge_sorted(a, b):\n    \"\"\"Merge two sorted lists.\"\"\"\n", chat=False)
    return [chat, code]


@pytest.fixture(scope="module")
def plain(pair, prompts):
    engine = build_engine(pair, SpecConfig(method="none"))
    stop = StopRules(max_tokens=24, eos_ids=tuple(eos_ids(pair.tokenizer, pair.target)))
    return [engine.generate(ids, GREEDY, SpecConfig(method="none"), stop).tokens for ids in prompts]


@pytest.mark.parametrize("name", list(METHODS))
def test_greedy_speculation_equals_plain_decoding(pair, prompts, plain, name):
    spec = METHODS[name]
    if spec.drafter == "model":
        spec = dataclasses.replace(spec, draft_vocab=resolve_draft_vocab(pair, "auto"))
    engine = build_engine(pair, spec)
    stop = StopRules(max_tokens=24, eos_ids=tuple(eos_ids(pair.tokenizer, pair.target)))
    for ids, expected in zip(prompts, plain):
        result = engine.generate(ids, GREEDY, spec, stop)
        assert result.tokens == expected


@pytest.mark.parametrize("spec", [SpecConfig(method="chain", gamma=4), SpecConfig(method="tree", tree="s3_k2_d6")],
                         ids=["chain", "tree"])
def test_the_embedded_draft_drafts_for_smollm2_across_tokenizers(pair, prompts, plain, spec):
    """The tiny pair's draft (its own 8,192-token vocabulary) drafts over the tokens it shares with
    SmolLM2's, and greedy decoding is unchanged."""
    from verispec.drafters.cross_vocab import CrossVocabDrafter
    from verispec.loading import DEFAULT_DRAFT, load_model, load_tokenizer
    from verispec.vocab import VocabBridge

    draft = load_model(DEFAULT_DRAFT)
    bridge = VocabBridge.build(pair.tokenizer, load_tokenizer(DEFAULT_DRAFT), pair.target.config.vocab_size, 8192)
    assert 6000 < bridge.shared < 8192
    crossed = dataclasses.replace(pair, draft=draft, draft_dir=DEFAULT_DRAFT, bridge=bridge)
    engine = build_engine(crossed, spec)
    assert isinstance(engine.drafter, CrossVocabDrafter)
    stop = StopRules(max_tokens=24, eos_ids=tuple(eos_ids(pair.tokenizer, pair.target)))
    accepted = 0
    for ids, expected in zip(prompts, plain):
        result = engine.generate(ids, GREEDY, spec, stop)
        assert result.tokens == expected
        accepted += result.stats.accepted
    assert accepted > 0


def test_a_short_audit_of_the_shipped_default_passes(pair):
    """The default pair as served (int8 draft, its 8,192-token draft vocabulary) at t=1: a small audit
    (150 samples, 2 draft positions) on a 3-token prompt, so a gross loss of exactness in the shipped configuration
    fails CI."""
    from verispec.audit import AuditConfig, run_audit

    spec = SpecConfig(gamma=4, draft_vocab=resolve_draft_vocab(pair, "auto"))
    prompt = encode_prompt(pair.tokenizer, "The sea is", chat=False)
    report = run_audit(build_engine(pair, spec), [prompt], SamplingParams(temperature=1.0), spec,
                       AuditConfig(tokens=4, samples=150, seed=0))
    assert report.passed, report.as_dict()
    assert report.prompts[0].drafted > 0 and report.prompts[0].accepted > 0


def test_the_shipped_draft_shares_the_targets_embedding_and_rows(pair):
    assert pair.draft.model.embed_tokens.weight is pair.target.model.embed_tokens.weight
    assert pair.draft.lm_head.gguf_blocks[1] is pair.target.lm_head.gguf_blocks[1]
    assert resolve_draft_vocab(pair, "auto") == 8192
    assert pair.draft.config.num_hidden_layers < pair.target.config.num_hidden_layers


def test_batched_greedy_equals_plain(pair, prompts, plain):
    """The server's engine: three requests decoded together, each as plain decoding alone."""
    from verispec.batch import BatchEngine, BatchRequest

    spec = SpecConfig(gamma=4, draft_vocab=resolve_draft_vocab(pair, "auto"))
    engine = BatchEngine(pair.target, pair.draft, spec, max_batch=3, max_len=512)
    stop = StopRules(max_tokens=24, eos_ids=tuple(eos_ids(pair.tokenizer, pair.target)))
    queue = [BatchRequest(str(i), ids, GREEDY, stop) for i, ids in enumerate(prompts + prompts[:1])]
    out = {}
    for request in queue:
        for event in engine.add(request):
            out.setdefault(event.request_id, []).extend(event.tokens)
    while engine.active:
        for event in engine.step():
            out.setdefault(event.request_id, []).extend(event.tokens)
    assert [out[str(i)] for i in range(3)] == plain + plain[:1]


def test_demo_runs_on_smollm2(pair, capsys):
    from verispec.cli import main

    code = main(["demo", "--prompts", "1", "--max-tokens", "12", "--methods", "chain,ngram", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0 and data["target"] == "smollm2"
    assert {row["workload"] for row in data["prompts"]} == {"code", "chat", "math"}
    assert all(row["identical"] for row in data["prompts"])
