"""The greedy fast path equals the general chain verifier on one-hot target probs and point-mass drafts."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verispec.verify.chain import verify_chain, verify_chain_greedy


@settings(max_examples=200, deadline=None)
@given(st.integers(2, 6).flatmap(lambda v: st.tuples(
    st.just(v), st.lists(st.integers(0, v - 1), max_size=6), st.data())))
def test_greedy_fast_path_matches_general_verifier(case):
    vocab, drafts, data = case
    argmax = data.draw(st.lists(st.integers(0, vocab - 1), min_size=len(drafts) + 1, max_size=len(drafts) + 1))
    one_hot_p = torch.nn.functional.one_hot(torch.tensor(argmax), vocab).float()
    uniform = data.draw(st.floats(0, 0.999))
    general = verify_chain(draft_tokens=torch.tensor(drafts, dtype=torch.long), draft_probs=None,
                           target_probs=one_hot_p, uniforms=torch.full((len(drafts),), uniform),
                           final_uniform=uniform)
    assert verify_chain_greedy(drafts, argmax) == general


@settings(max_examples=200, deadline=None)
@given(st.integers(2, 5).flatmap(lambda v: st.tuples(
    st.just(v), st.lists(st.integers(0, 10), min_size=1, max_size=8), st.data())))
def test_greedy_tree_fast_path_matches_general_tree_verifier(case):
    """Random trees (parent of node i drawn among 0..i-1, duplicate sibling tokens allowed) with one-hot
    target rows: the fast path equals verify_tree in deterministic mode whatever the uniforms."""
    from verispec.tree import TokenTree
    from verispec.verify.tree import verify_tree, verify_tree_greedy

    vocab, parent_draws, data = case
    parents = [-1] + [draw % (i + 1) for i, draw in enumerate(parent_draws)]
    tokens = [0] + data.draw(st.lists(st.integers(0, vocab - 1), min_size=len(parents) - 1,
                                      max_size=len(parents) - 1))
    argmax = data.draw(st.lists(st.integers(0, vocab - 1), min_size=len(parents), max_size=len(parents)))
    tree = TokenTree(parents=parents, tokens=tokens)
    one_hot_p = torch.nn.functional.one_hot(torch.tensor(argmax), vocab).float()
    uniform = data.draw(st.floats(0, 0.999))
    general = verify_tree(tree, one_hot_p, "deterministic", uniforms=torch.full((len(parents) - 1,), uniform),
                          final_uniform=uniform)
    assert verify_tree_greedy(tree, argmax) == general
