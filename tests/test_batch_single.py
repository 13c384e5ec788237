"""verispec.batch.single: one request at a time through the batched engine gives SpecEngine's result."""

from __future__ import annotations

import pytest

from test_batch import GREEDY, models, requests  # noqa: F401 (fixture)
from verispec.batch.single import BatchOfOne
from verispec.config import SamplingParams, SpecConfig
from verispec.drafters import DraftModelDrafter, NgramDrafter
from verispec.engine import SpecEngine
from verispec.errors import VerispecError


@pytest.mark.parametrize("spec", [SpecConfig(gamma=4), SpecConfig(method="tree", tree="s3_k2_d6"),
                                  SpecConfig(gamma=3, drafter="ngram"), SpecConfig(method="none")],
                         ids=["chain", "tree", "ngram", "off"])
@pytest.mark.parametrize("sampling", [GREEDY, SamplingParams(temperature=1.0, top_k=20)], ids=["greedy", "sampled"])
def test_a_batch_of_one_gives_spec_engines_result(models, spec, sampling):  # noqa: F811
    target, draft = models
    make = (lambda: NgramDrafter()) if spec.drafter == "ngram" else (lambda: DraftModelDrafter(draft))
    single = BatchOfOne(SpecEngine(target, make() if spec.enabled else None), spec)
    for request in requests(5, sampling, seed=4):  # one engine, one request after another
        alone = SpecEngine(target, make() if spec.enabled else None).generate(
            request.prompt_ids, sampling, spec, request.stop, seed=request.seed)
        result = single.generate(request.prompt_ids, sampling, spec, request.stop, seed=request.seed)
        assert result.tokens == alone.tokens and result.finish_reason == alone.finish_reason
        assert result.stats.generated_tokens == len(result.tokens) and result.stats.e2e_s > 0


def test_a_batch_of_one_refuses_another_spec(models):  # noqa: F811
    target, draft = models
    single = BatchOfOne(SpecEngine(target, DraftModelDrafter(draft)), SpecConfig(gamma=4))
    with pytest.raises(VerispecError, match="another SpecConfig"):
        single.generate([1, 2, 3], GREEDY, SpecConfig(gamma=2))


def test_a_batch_of_one_streams_spec_engines_chunks(models):  # noqa: F811
    """stream(): one chunk per round, as SpecEngine streams them; a stream left unfinished (a client gone,
    a timeout) does not block the next request."""
    target, draft = models
    spec, sampling = SpecConfig(gamma=3), SamplingParams(temperature=1.0)
    single = BatchOfOne(SpecEngine(target, DraftModelDrafter(draft)), spec)
    abandoned = single.stream([5, 6, 7], sampling, spec, requests(1, sampling)[0].stop, seed=9)
    assert next(abandoned)  # the prefill's token
    for request in requests(4, sampling, seed=2):
        reference = SpecEngine(target, DraftModelDrafter(draft)).stream(request.prompt_ids, sampling, spec,
                                                                        request.stop, seed=request.seed)
        generation = single.stream(request.prompt_ids, sampling, spec, request.stop, seed=request.seed)
        chunks = list(generation)
        assert chunks == list(reference) and all(chunks)
        assert generation.result.tokens == reference.result.tokens == [t for c in chunks for t in c]
        assert generation.result.finish_reason == reference.result.finish_reason
