"""verispec.batch.rows: rows that draft with a drafter of their own, and the padded inputs that verify
their chains and trees in one target pass."""

from __future__ import annotations

import pytest
import torch

from verispec.batch.requests import BatchRequest, Row
from verispec.batch.rows import RowDrafters, propose_own, tree_inputs
from verispec.config import SamplingParams, SpecConfig, StopRules
from verispec.drafters.base import DrafterBase, Proposal
from verispec.errors import VerispecError
from verispec.stats import RequestStats
from verispec.tree import TokenTree


def test_chains_and_trees_are_padded_to_the_widest_row():
    tree = TokenTree(parents=[-1, 0, 0, 1], tokens=[20, 5, 6, 7])  # root 20; 5 and 6 its children; 7 under 5
    fed, masks, depths = tree_inputs([10, 20], [[1, 2], []], [None, tree])
    assert fed.tolist() == [[10, 1, 2, 10], [20, 5, 6, 7]]  # the chain row padded with its root
    assert masks[0].int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [0, 0, 0, 1]]
    assert masks[1].int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]
    assert depths.tolist() == [[0, 1, 2, 0], [0, 1, 1, 2]]


class Recording(DrafterBase):
    """Proposes fixed drafts and records the calls the pool and ``propose_own`` make."""

    def __init__(self):
        self.resets, self.calls = 0, []

    def propose(self, context, num_drafts, sampling, generator):
        self.calls.append(("chain", num_drafts))
        return Proposal(torch.arange(num_drafts), None)

    def propose_tree(self, context, shape, mode, sampling, generator):
        self.calls.append(("tree", mode))
        parents = [-1] + list(range(shape.depth))  # a chain-shaped tree of the shape's depth
        return Proposal(torch.arange(shape.depth), None, TokenTree(parents, list(range(shape.depth + 1))))

    def commit(self, context): ...

    def reset(self):
        self.resets += 1


def test_the_pool_lends_released_drafters_again_reset():
    made = []
    pool = RowDrafters(lambda: made.append(Recording()) or made[-1])
    first, second = pool.acquire(), pool.acquire()
    assert first is not second and len(made) == 2
    pool.release(first)
    assert pool.acquire() is first and first.resets == 2 and len(made) == 2
    with pytest.raises(VerispecError, match="does not implement the Drafter protocol"):
        RowDrafters(object).acquire()


def row_with(drafter, max_tokens: int, sampling=SamplingParams(temperature=0.0)) -> Row:
    request = BatchRequest("r", [1, 2], sampling, StopRules(max_tokens=max_tokens))
    return Row(request, [1, 2], torch.Generator(), RequestStats(), 0.0, 0.0, drafter=drafter)


def test_a_row_proposes_a_tree_where_it_fits_cut_to_its_tokens_left_else_a_chain():
    spec = SpecConfig(method="tree", tree="s4_k1_d5", sibling_mode="iid")
    drafter = Recording()
    tree = propose_own(row_with(drafter, max_tokens=3), spec, 4, room=100, bind_view=None)
    assert drafter.calls == [("tree", "deterministic")]  # greedy rows draw siblings deterministically
    assert tree.num_drafts == 2  # two drafts and the token after them are all 3 tokens left
    chain = propose_own(row_with(drafter, max_tokens=50), spec, 4, room=2, bind_view=None)
    assert drafter.calls[-1] == ("chain", 4) and chain.tree is None  # no room for the tree
    assert propose_own(row_with(drafter, 50), SpecConfig(gamma=3), 0, room=100, bind_view=None).num_drafts == 0
    assert len(drafter.calls) == 2  # gamma 0: the drafter is not asked
