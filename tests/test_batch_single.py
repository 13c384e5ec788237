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
