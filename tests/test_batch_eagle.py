"""verispec.batch.eagle: the EAGLE head drafts every row's chain at once and gives each request the tokens
the per-row EagleDrafter gives it alone, long prompts (paired alone first) included."""

from __future__ import annotations

import random

import pytest

from test_batch import alone, models, run_batched  # noqa: F401 (fixture)
from test_batch_drafters import head  # noqa: F401 (fixture)
from verispec.batch import BatchEngine, BatchRequest
from verispec.batch.draft import CATCH_UP_ALONE
from verispec.batch.eagle import BatchedEagle
from verispec.config import SamplingParams, SpecConfig, StopRules
from verispec.drafters.eagle import EagleDrafter


@pytest.mark.parametrize("sampling", [SamplingParams(temperature=0), SamplingParams(temperature=1.0, top_k=8)],
                         ids=["greedy", "sampled"])
def test_the_shared_head_drafts_each_row_as_its_own_drafter_would(models, head, sampling):  # noqa: F811
    target, draft = models
    spec = SpecConfig(gamma=3, drafter="eagle")
    rng = random.Random(7)
    # Prompts both shorter and longer than CATCH_UP_ALONE: the long ones are paired alone before the round.
    queue = [BatchRequest(str(i), [rng.randrange(64) for _ in range(rng.choice([3, 9, CATCH_UP_ALONE + 12]))],
                          sampling, StopRules(max_tokens=6 + i % 7), seed=i) for i in range(9)]
    engine = BatchEngine(target, draft, spec, max_batch=3, eagle=head)
    assert isinstance(engine.draft, BatchedEagle) and engine.own is None and engine.feeds_features
    out, finished = run_batched(engine, queue)
    assert set(finished) == {r.request_id for r in queue}
    assert sum(r.drafted for e in finished.values() for r in e.stats.rounds) > 0
    for request in queue:
        assert out[request.request_id] == alone(target, EagleDrafter(head, target.config.max_context), request, spec)


def test_every_committed_tokens_features_are_paired_or_wait_on_the_row(models, head):  # noqa: F811
    """After the prefill the prompt's features wait on the row; after each round the head holds a pair for
    every committed token but those whose features arrived since (the round's own path)."""
    target, draft = models
    spec = SpecConfig(gamma=2, drafter="eagle")
    engine = BatchEngine(target, draft, spec, max_batch=2, eagle=head)
    request = BatchRequest("a", [5, 9, 12, 3], SamplingParams(temperature=0), StopRules(max_tokens=12))
    engine.add(request)
    sequence = engine.rows[0]
    assert sequence.paired == 0 and sum(f.shape[0] for f in sequence.features) == 4
    engine.step()
    assert sequence.paired == len(sequence.context) - 1 - sum(f.shape[0] for f in sequence.features)
    run_batched(engine, [])
    assert len(sequence.generated) == 12
