"""verispec.batch.requests: what goes into and out of the batched engine; committed tokens' logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from verispec.batch.requests import MIN_LOGPROB, BatchEvent, BatchRequest, Row, token_logprobs
from verispec.config import StopRules
from verispec.stats import RequestStats


def test_raw_logprobs_are_the_log_softmax_with_the_best_alternatives_first():
    logits = torch.tensor([[0.0, 1.0, 2.0], [3.0, 0.0, 0.0], [9.0, 9.0, 9.0]])  # (T=3, V=3); row 2 unused
    got = token_logprobs(logits, [0, 0], top_n=2)
    expected = torch.log_softmax(logits[:2], dim=-1)
    assert [entry.logprob for entry in got] == pytest.approx([expected[0, 0].item(), expected[1, 0].item()])
    assert got[0].top_ids == (2, 1) and got[1].top_ids[0] == 0
    assert got[0].top_logprobs == pytest.approx((expected[0, 2].item(), expected[0, 1].item()))
    assert token_logprobs(logits, [1], top_n=0)[0].top_ids == ()
    assert len(token_logprobs(logits, [1], top_n=50)[0].top_ids) == 3  # no more alternatives than the vocabulary


def test_processed_logprobs_are_the_sampled_distributions_with_a_floor_for_zero():
    probs = torch.tensor([[0.5, 0.5, 0.0], [0.0, 1.0, 0.0]])
    got = token_logprobs(torch.zeros(2, 3), [0, 2], top_n=1, probs=probs)
    assert got[0].logprob == pytest.approx(math.log(0.5)) and got[1].logprob == MIN_LOGPROB
    assert got[1].top_ids == (1,) and got[1].top_logprobs == (0.0,)


def test_an_event_is_finished_once_it_has_a_reason_and_a_row_counts_what_is_left():
    assert not BatchEvent("a", [1, 2]).finished and BatchEvent("a", [], "abort").finished
    request = BatchRequest("a", [1, 2, 3], stop=StopRules(max_tokens=5))
    row = Row(request, [1, 2, 3], torch.Generator(), RequestStats(), started=0.0, last_emit=0.0)
    row.generated += [7, 8]
    assert row.remaining == 3
