"""verispec.guide: a request's penalties and grammar mask as one stateful transform of the logits (the
engine-level tests are in test_penalties.py and test_grammar.py)."""

from __future__ import annotations

import torch

from test_penalties import reference_penalized
from verispec.config import SamplingParams
from verispec.guide import Guide, Rows, with_point_masses


def test_rows_apply_the_reference_formula():
    torch.manual_seed(0)
    sampling = SamplingParams(presence_penalty=0.5, frequency_penalty=-0.3, repetition_penalty=1.7)
    prompt, output = [1, 2, 2, 9], [3, 3, 5, 1]
    guide = Guide.for_request(sampling, prompt, 12)
    guide.advance(output[:2])
    allowed, forced, rows = guide.round_masks(output[2:])
    logits = torch.randn(3, 12)
    got = rows.apply(logits)
    for i in range(3):
        expected = reference_penalized(logits[i], prompt, output[:2 + i], sampling)
        assert torch.allclose(got[i].double(), expected, atol=1e-6), i
    assert allowed == 2 and forced == []
    guide.unstage()
    assert torch.allclose(guide.mask().apply(logits[0]).double(), reference_penalized(logits[0], prompt, output[:2],
                                                                                      sampling), atol=1e-6)


def test_tree_rows_count_each_nodes_own_path():
    sampling = SamplingParams(frequency_penalty=1.0)
    guide = Guide.for_request(sampling, [0], 8)
    guide.advance([4])
    rows = guide.tree_masks([-1, 0, 0, 1, 3], [4, 5, 4, 5, 6])
    assert rows.counts[:, 4].tolist() == [1, 1, 2, 1, 1] and rows.counts[:, 5].tolist() == [0, 1, 0, 2, 2]
    assert rows.counts[4, 6] == 1 and rows.counts[3, 6] == 0


def test_no_penalties_and_no_grammar_means_no_guide():
    assert Guide.for_request(SamplingParams(temperature=0.5), [1, 2], 8) is None


def test_a_mask_forbids_with_minus_infinity_and_a_narrower_draft_gets_its_first_ids():
    rows = Rows(mask=torch.tensor([True, False, True, False]))
    assert rows.apply(torch.tensor([1.0, 2.0, 3.0, 4.0])).tolist() == [1.0, float("-inf"), 3.0, float("-inf")]
    assert rows.apply(torch.tensor([1.0, 2.0])).tolist() == [1.0, float("-inf")]  # a head scoring 2 ids


def test_point_masses_follow_the_draft_rows():
    probs = torch.tensor([[0.25, 0.75, 0.0]])
    assert with_point_masses(probs, [2, 0]).tolist() == [[0.25, 0.75, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]]
    assert with_point_masses(probs, []) is probs and with_point_masses(None, [1]) is None


def test_path_masks_count_only_the_path_from_the_start():
    guide = Guide.for_request(SamplingParams(presence_penalty=1.0), [7], 8)
    guide.advance([3, 3])  # the output so far does not count: path_masks start from the request's start
    rows, allowed = guide.path_masks([5, 5])
    assert allowed == 2 and rows.counts[:, 5].tolist() == [0, 1, 2] and rows.counts[:, 3].tolist() == [0, 0, 0]
    assert rows.seen[0, 7] and not rows.seen[0, 5]  # the prompt counts for the repetition penalty
