"""Presence, frequency and repetition penalties (verispec.guide), exact under speculation.

The slow reference recomputes every position from scratch: the target's logits over prompt + output so
far, the penalties from counting that output, then greedy argmax. Every method must give its tokens;
sampled output must follow the penalized target's exact distribution (teacher forcing with the same
penalties along each sequence), and a drafter that reports an unpenalized q must fail that test.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from verispec.audit import goodness_of_fit, sample_continuations, sample_seeds, sequence_probabilities
from verispec.batch import BatchEngine, BatchRequest
from verispec.config import SamplingParams, SpecConfig, StopRules
from verispec.drafters import DraftModelDrafter
from verispec.engine import SpecEngine
from verispec.errors import SamplingError
from verispec.loading import ModelPair, build_engine, load_pair

PENALIZED = SamplingParams(temperature=0, presence_penalty=0.8, frequency_penalty=0.4, repetition_penalty=1.6)
SPECS = {"plain": SpecConfig(method="none"), "chain": SpecConfig(gamma=3), "ngram": SpecConfig(drafter="ngram"),
         "self": SpecConfig(drafter="early_exit", exit_layer=1), "tree": SpecConfig(method="tree", tree="s3_k2_d6"),
         "dynamic": SpecConfig(method="tree", tree="dynamic:8"), "perfect": SpecConfig(gamma=4)}


@pytest.fixture(scope="module")
def pair(byte_pair) -> ModelPair:
    return load_pair(*byte_pair, draft_weights="native")


def engine_for(pair, method: str) -> SpecEngine:
    if method == "perfect":  # the target drafts for itself: long accepted runs, each draft penalized in turn
        return SpecEngine(pair.target, DraftModelDrafter(pair.target))
    return build_engine(pair, SPECS[method])


def reference_penalized(logits: torch.Tensor, prompt: list[int], output: list[int], sampling: SamplingParams):
    """vLLM's order, written out: repetition over prompt + output, then presence and frequency over the
    output's counts."""
    logits = logits.clone().double()
    for token in set(prompt) | set(output):
        value = logits[token]
        logits[token] = value / sampling.repetition_penalty if value > 0 else value * sampling.repetition_penalty
    for token in set(output):
        logits[token] -= sampling.presence_penalty + sampling.frequency_penalty * output.count(token)
    return logits


def slow_greedy(target, prompt: list[int], sampling: SamplingParams, tokens: int) -> list[int]:
    output: list[int] = []
    with torch.inference_mode():
        for _ in range(tokens):
            logits = target.train_forward(torch.tensor([prompt + output]))[0][0, -1]
            output.append(int(reference_penalized(logits, prompt, output, sampling).argmax()))
    return output


@pytest.mark.parametrize("name, value", [("presence_penalty", 2.5), ("frequency_penalty", -3.0),
                                         ("repetition_penalty", 0.0), ("repetition_penalty", float("inf"))])
def test_out_of_range_penalties_are_user_errors(name, value):
    with pytest.raises(SamplingError, match=name):
        SamplingParams(**{name: value})


def test_greedy_penalized_output_is_the_slow_references_for_every_method(pair):
    prompt = pair.tokenizer.encode("aaaa bbbb aaaa bbbb ", add_special_tokens=False)
    stop = StopRules(max_tokens=24, ignore_eos=True)
    expected = slow_greedy(pair.target, prompt, PENALIZED, 24)
    unpenalized = engine_for(pair, "plain").generate(prompt, SamplingParams(temperature=0), SPECS["plain"], stop)
    assert unpenalized.tokens != expected  # the penalties change this output: the test can tell
    for method, spec in SPECS.items():
        result = engine_for(pair, method).generate(prompt, PENALIZED, spec, stop)
        assert result.tokens == expected, method
        if method not in ("plain", "ngram"):
            assert result.stats.drafted > 0, method
        if method == "perfect":  # accepted drafts: each one penalized for the drafts before it
            assert result.stats.accepted > 10


def test_batched_penalized_rows_decode_as_the_slow_reference(pair):
    prompts = [pair.tokenizer.encode(text, add_special_tokens=False) for text in ("abab ", "xyz xyz ", "1 2 1 2 ")]
    params = [PENALIZED, SamplingParams(temperature=0), replace(PENALIZED, repetition_penalty=1.0)]
    stop = StopRules(max_tokens=16, ignore_eos=True)
    engine = BatchEngine(pair.target, pair.draft, SpecConfig(gamma=3), max_batch=3)
    outputs: dict[str, list[int]] = {}
    for index, (prompt, sampling) in enumerate(zip(prompts, params)):
        for event in engine.add(BatchRequest(str(index), prompt, sampling, stop)):
            outputs.setdefault(event.request_id, []).extend(event.tokens)
    while engine.active:
        for event in engine.step():
            outputs.setdefault(event.request_id, []).extend(event.tokens)
    for index, (prompt, sampling) in enumerate(zip(prompts, params)):
        assert outputs[str(index)] == slow_greedy(pair.target, prompt, sampling, 16), index


AUDIT = SamplingParams(temperature=1.0, top_k=3, presence_penalty=2.0, frequency_penalty=0.5, repetition_penalty=3.0)


def fit_of(pair, engine, spec, sampling=AUDIT, samples=1500):
    prompt = pair.tokenizer.encode("ab", add_special_tokens=False)
    counts, drafted, accepted = sample_continuations(engine, prompt, sampling, spec, 4, sample_seeds(3, 0, samples))
    return goodness_of_fit(counts, sequence_probabilities(pair.target, prompt, list(counts), sampling)), drafted, accepted


@pytest.mark.parametrize("method", ["chain", "perfect", "tree"])
def test_sampled_penalized_output_follows_the_penalized_target_exactly(pair, method):
    spec = SPECS[method] if method != "tree" else replace(SPECS["tree"], sibling_mode="without_replacement")
    fit, drafted, accepted = fit_of(pair, engine_for(pair, method), spec, samples=600 if method == "tree" else 1000)
    assert not fit.impossible and fit.p_value > 1e-3 and fit.tv < 2 * fit.noise_floor, fit
    assert drafted > 0
    if method == "perfect":  # the target drafting for itself under the same penalties: mostly accepted
        assert accepted > 0.5 * drafted


def test_the_audit_fails_a_drafter_that_samples_without_the_penalties(pair, monkeypatch):
    """The classic bug: drafts sampled from the unpenalized distribution but reported with the penalized
    q. With the target drafting for itself every such draft is accepted: the output loses the penalties."""
    import verispec.drafters.draft_model as draft_model
    from verispec.sampling import draw_draft, logits_to_probs

    def unpenalized_draws(logits, params, generator):
        row = params.guide.mask()
        token, q = draw_draft(logits, replace(params, guide=None), generator)
        params.guide.stage(token)
        return token, None if q is None else logits_to_probs(row.apply(logits), params)

    monkeypatch.setattr(draft_model, "draw_draft", unpenalized_draws)
    fit, _, _ = fit_of(pair, engine_for(pair, "perfect"), SPECS["perfect"], samples=600)
    assert fit.impossible or fit.p_value < 1e-3, fit
