"""verispec.drafters.draft_model: a small draft model proposing chains and trees with its own cache (the
engine-level tests of its trees are in test_engine_tree.py)."""

from __future__ import annotations

import torch

from verispec.config import SamplingParams, TreeShape
from verispec.drafters.draft_model import best_pool_nodes, pool_path, static_tree


def test_top_tokens_match_a_stable_descending_sort_ties_included():
    from verispec.drafters.draft_model import top_tokens

    generator = torch.Generator().manual_seed(0)
    for trial in range(400):
        # Small integer logits force ties at the cut; Gaussian ones cover the usual case.
        values = (torch.randint(0, 6, (50,), generator=generator).float() if trial % 2
                  else torch.randn(8192, generator=generator))
        count = 1 + trial % 5
        assert top_tokens(values, count) == torch.sort(values, descending=True, stable=True).indices[:count].tolist()


def test_pool_paths_and_the_best_nodes_parents_first():
    # entries: (parent, token, score, depth, prob, rank)
    pool = [(-1, 7, 0.0, 0, 1.0, 0), (0, 3, -0.1, 1, 0.9, 0), (0, 4, -2.0, 1, 0.1, 1), (1, 5, -0.2, 2, 0.8, 0),
            (3, 6, -0.3, 3, 0.7, 0)]
    assert pool_path(pool, 4) == [3, 5, 6] and pool_path(pool, 0) == []
    assert best_pool_nodes(pool, 3) == [0, 1, 3, 4]  # the deep path beats the unlikely sibling
    assert best_pool_nodes(pool, 4) == [0, 1, 2, 3, 4]


def test_a_deterministic_static_tree_takes_the_top_children_along_its_main_path():
    """s3_k2_d5 over a 5-token vocabulary whose logits prefer token (last + 1) % 5: each level's first
    child is the best token and becomes the next main node; the one extra node widens level 1."""
    def logits_after(token):
        return torch.tensor([4.0 if i == (token + 1) % 5 else float(-i) for i in range(5)])

    shape = TreeShape.parse("s3_k2_d5")
    proposal = static_tree(0, shape, "deterministic", SamplingParams(temperature=0.0), torch.Generator(),
                           logits_after(0), logits_after)
    tree = proposal.tree
    assert tree.parents == [-1, 0, 0, 1, 3] and tree.tokens == [0, 1, 0, 2, 3]
    assert proposal.tokens.tolist() == [1, 0, 2, 3] and tree.draft_probs is None
