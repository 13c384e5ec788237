"""tree.py: a token tree compiles into the mask, depths, paths and children one forward pass needs.

The checks are small enough to verify by hand: the docstring's four-node tree, and a chain (the tree
with one child per node), whose mask must be the ordinary causal (lower-triangular) mask.
"""

from __future__ import annotations

import doctest

import pytest
import torch

import verispec.tree
from verispec.tree import TokenTree


def test_module_docstring_example_holds():
    assert doctest.testmod(verispec.tree).failed == 0


def test_docstring_tree_compiles_to_the_hand_checked_buffers():
    # 0 (root, token 7) -> 1 (token 3) -> 3 (token 9)
    #                   -> 2 (token 5)
    tree = TokenTree(parents=[-1, 0, 0, 1], tokens=[7, 3, 5, 9])
    buffers = tree.compile()
    assert buffers.ancestor_mask.dtype == torch.bool
    assert buffers.ancestor_mask.int().tolist() == [[1, 0, 0, 0],
                                                     [1, 1, 0, 0],
                                                     [1, 0, 1, 0],   # node 2 never sees its sibling 1
                                                     [1, 1, 0, 1]]   # nor its cousin 2
    assert buffers.depths.tolist() == [0, 1, 1, 2]
    assert buffers.paths == [[0, 1, 3], [0, 2]]
    assert buffers.children == [[1, 2], [3], [], []]
    assert tree.num_nodes == 3
    assert tree.path_to(3) == [1, 3] and tree.path_to(2) == [2] and tree.path_to(0) == []


def test_siblings_keep_their_draw_order_and_duplicate_tokens_stay_separate_nodes():
    tree = TokenTree(parents=[-1, 0, 0, 0, 2], tokens=[4, 1, 1, 0, 1])
    buffers = tree.compile()
    assert buffers.children == [[1, 2, 3], [], [4], [], []]
    assert buffers.paths == [[0, 1], [0, 2, 4], [0, 3]]
    assert buffers.depths.tolist() == [0, 1, 1, 1, 2]


@pytest.mark.parametrize("length", [1, 2, 5])
def test_a_chain_is_a_degenerate_tree_with_a_causal_mask(length):
    tree = TokenTree(parents=[-1] + list(range(length)), tokens=list(range(10, 11 + length)))
    buffers = tree.compile()
    size = length + 1
    assert torch.equal(buffers.ancestor_mask, torch.ones(size, size, dtype=torch.bool).tril())
    assert buffers.depths.tolist() == list(range(size))
    assert buffers.paths == [list(range(size))]
    assert buffers.children == [[node + 1] for node in range(length)] + [[]]
    assert tree.path_to(length) == list(range(1, size))


def test_a_root_alone_is_one_path():
    buffers = TokenTree(parents=[-1], tokens=[3]).compile()
    assert buffers.ancestor_mask.tolist() == [[True]] and buffers.paths == [[0]] and buffers.children == [[]]


@pytest.mark.parametrize("parents", [[-1, 2, 0], [-1, 1], [-1, 0, 3, 1]])
def test_a_parent_after_its_child_is_rejected(parents):
    with pytest.raises(AssertionError, match="parents must precede children"):
        TokenTree(parents=parents, tokens=list(range(len(parents))))


def test_pruned_keeps_the_nodes_a_short_budget_can_commit():
    probs = torch.eye(5)
    tree = TokenTree(parents=[-1, 0, 0, 1, 3], tokens=[4, 1, 2, 3, 0], draft_probs=probs)
    cut = tree.pruned(1)
    assert (cut.parents, cut.tokens) == ([-1, 0, 0], [4, 1, 2]) and torch.equal(cut.draft_probs, probs[:3])
    two = tree.pruned(2)
    assert (two.parents, two.tokens) == ([-1, 0, 0, 1], [4, 1, 2, 3])
    assert tree.pruned(3) is tree and tree.pruned(0).tokens == [4]
