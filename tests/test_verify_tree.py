"""verify/tree.py against the exact Fraction oracle, and exact losslessness of tree rounds in every mode.

Three kinds of checks (statistical ones live in test_verify_tree_statistical.py):

* Draw for draw: random trees (up to 8 nodes, V 2..5, probabilities with zeros) replayed with the same
  uniforms through ``verify_tree`` (floats) and ``verify_tree_exact`` (Fractions of the very same float
  values) must give identical results. Floats and Fractions can only disagree when a uniform sits on a
  threshold up to rounding, so a case is redrawn (random) or discarded (hypothesis) when moving any one
  uniform by 1e-9 changes the exact result.
* Exact losslessness: ``tree_spec_sequence_distribution`` enumerates every drafting outcome and every
  accept/reject branch of repeated tree rounds on a V = 3 toy model; the distribution of the first three
  tokens must equal the target's own, to the last digit, for every mode and tree shape.
* Teeth: two known mistakes, plugged into the same enumerator, must break that equality: an iid verifier
  that skips a sibling whose token was already rejected (without updating p), and one that recovers from
  p instead of the residual when every child is rejected.
"""

from __future__ import annotations

import doctest
import random
from dataclasses import dataclass
from fractions import Fraction as F
from typing import Callable

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from verispec.tree import TokenTree
from verispec.verify import exact
from verispec.verify.exact import (ToyModel, chain_round_outcomes, sibling_draws, sibling_outcomes,
                                   target_sequence_distribution, tree_round_outcomes,
                                   tree_spec_sequence_distribution, verify_tree_exact)
from verispec.verify.tree import SIBLING_MODES, TreeResult, verify_tree

TIE_MARGIN = 1e-9
MAX_NODES = 8
NUM_RANDOM_CASES = 150


# --- draw for draw: float vs exact -------------------------------------------------------------------

@dataclass
class TreeCase:
    mode: str
    parents: list[int]
    tokens: list[int]
    draft_probs: torch.Tensor | None  # (N+1, V); None in deterministic mode (q is a point mass)
    target_probs: torch.Tensor  # (N+1, V)
    uniforms: list[float]  # (N,): node i uses uniforms[i - 1]
    final_uniform: float

    def run_float(self) -> TreeResult:
        tree = TokenTree(self.parents, self.tokens, self.draft_probs)
        return verify_tree(tree, self.target_probs, self.mode, torch.tensor(self.uniforms, dtype=torch.float64),
                           self.final_uniform)

    def run_exact(self, uniforms: list[float] | None = None, final_uniform: float | None = None) -> TreeResult:
        uniforms = self.uniforms if uniforms is None else uniforms
        final_uniform = self.final_uniform if final_uniform is None else final_uniform
        draft = None if self.draft_probs is None else to_fractions(self.draft_probs)
        return verify_tree_exact(self.parents, self.tokens, draft, to_fractions(self.target_probs), self.mode,
                                 [F(u) for u in uniforms], F(final_uniform))

    def near_a_tie(self) -> bool:
        """Does moving any one uniform by TIE_MARGIN change the exact result? Then floats may disagree."""
        result = self.run_exact()
        for delta in (-TIE_MARGIN, TIE_MARGIN):
            if self.run_exact(final_uniform=nudged(self.final_uniform, delta)) != result:
                return True
            for i in range(len(self.uniforms)):
                moved = self.uniforms[:i] + [nudged(self.uniforms[i], delta)] + self.uniforms[i + 1:]
                if self.run_exact(uniforms=moved) != result:
                    return True
        return False


def nudged(u: float, delta: float) -> float:
    return min(max(u + delta, 0.0), 1 - 1e-12)


def to_fractions(probs: torch.Tensor) -> list[list[F]]:
    """Exact Fractions of the float values, row by row."""
    return [[F(x) for x in row] for row in probs.tolist()]


def build_case(mode: str, pick: Callable[[int, int], int], pick_uniform: Callable[[], float],
               dtype: torch.dtype = torch.float64) -> TreeCase:
    """A random case from integer choices ``pick(low, high)`` (inclusive) and uniforms ``pick_uniform()``.

    Probabilities are small integer weights (about a third zero) normalised in float. Children follow
    their mode: iid children are drawn from q's support with duplicates (often the same token twice);
    without_replacement children of one node are distinct tokens of q's support; deterministic children
    are distinct tokens of any probability.
    """
    vocab, num_nodes = pick(2, 5), pick(1, MAX_NODES)

    def distribution() -> list[float]:
        weights = [pick(0, 2) * pick(1, 3) for _ in range(vocab)]
        weights[pick(0, vocab - 1)] += 1  # never all zero
        return [w / sum(weights) for w in weights]

    size = num_nodes + 1
    target = torch.tensor([distribution() for _ in range(size)], dtype=dtype)
    draft = torch.tensor([distribution() for _ in range(size)], dtype=dtype)
    allowed = {  # tokens a node's children may carry
        "iid": lambda node: [t for t in range(vocab) if draft[node, t] > 0],
        "without_replacement": lambda node: [t for t in range(vocab) if draft[node, t] > 0],
        "deterministic": lambda node: list(range(vocab)),
    }[mode]
    parents, tokens, siblings = [-1], [pick(0, vocab - 1)], {0: []}
    for node in range(1, size):
        distinct = mode != "iid"
        open_parents = [n for n in range(node) if not distinct or len(siblings[n]) < len(allowed(n))]
        parent = open_parents[pick(0, len(open_parents) - 1)]
        choices = [t for t in allowed(parent) if not distinct or t not in siblings[parent]]
        if mode == "iid" and siblings[parent] and pick(0, 2) == 0:
            choices = siblings[parent]  # a duplicate of an earlier sibling
        token = choices[pick(0, len(choices) - 1)]
        parents.append(parent)
        tokens.append(token)
        siblings[parent].append(token)
        siblings[node] = []
    uniforms = [pick_uniform() for _ in range(num_nodes)]
    return TreeCase(mode, parents, tokens, None if mode == "deterministic" else draft, target, uniforms,
                    pick_uniform())


def random_case(mode: str, seed: int) -> TreeCase:
    rng = random.Random(f"{mode}:{seed}")
    dtype = torch.float32 if seed % 2 else torch.float64  # float32 like logits_to_probs; verify_tree upcasts
    while True:
        case = build_case(mode, rng.randint, rng.random, dtype)
        if not case.near_a_tie():
            return case


def assert_invariants(case: TreeCase, result: TreeResult) -> None:
    """The result is a root-to-node path of accepted children, then a token the target allows there."""
    parent = 0
    for node in result.accepted_nodes:
        assert case.parents[node] == parent
        parent = node
    assert result.tokens[:-1] == [case.tokens[n] for n in result.accepted_nodes]
    is_leaf = parent not in case.parents
    assert result.last_kind == ("bonus" if is_leaf else "recovered")
    assert case.target_probs[parent, result.tokens[-1]] > 0


def tried_siblings(case: TreeCase, result: TreeResult) -> list[list[int]]:
    """For each node on the accepted path (root first): the children tried there, in order."""
    tried = []
    for node in [0] + result.accepted_nodes:
        kids = [n for n, parent in enumerate(case.parents) if parent == node]
        accepted = [n for n in kids if n in result.accepted_nodes]
        tried.append(kids[:kids.index(accepted[0]) + 1] if accepted else kids)
    return tried


@pytest.mark.parametrize("mode", SIBLING_MODES)
def test_float_matches_exact_on_random_trees(mode):
    seen = {"recovered": 0, "bonus": 0, "two_accepted": 0, "accepted_after_a_rejection": 0}
    if mode == "iid":
        seen["duplicate_tried_again"] = 0  # a sibling's token equals one tried (and rejected) before it
    for seed in range(NUM_RANDOM_CASES):
        case = random_case(mode, seed)
        result = case.run_float()
        assert result == case.run_exact(), (seed, case)
        assert_invariants(case, result)
        seen[result.last_kind] += 1
        seen["two_accepted"] += result.num_accepted >= 2
        tried = tried_siblings(case, result)
        seen["accepted_after_a_rejection"] += any(len(kids) >= 2 and kids[-1] in result.accepted_nodes
                                                  for kids in tried)
        if mode == "iid":
            seen["duplicate_tried_again"] += any(len({case.tokens[n] for n in kids}) < len(kids) for kids in tried)
    assert min(seen.values()) >= 10, seen  # every branch of the walk was compared many times


def test_deterministic_mode_ignores_draft_probs():
    case = random_case("deterministic", seed=3)
    tree = TokenTree(case.parents, case.tokens, torch.rand(case.target_probs.shape))
    uniforms = torch.tensor(case.uniforms, dtype=torch.float64)
    assert verify_tree(tree, case.target_probs, "deterministic", uniforms, case.final_uniform) == case.run_float()


def test_docstring_example_replays():
    # p_root = (0.5, 0.3, 0.2); children A, B; A rejected (0.6 >= 0.5), then B accepted (0.5 < 0.6).
    target = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8], [0.0, 0.0, 1.0]])
    tree = TokenTree([-1, 0, 0], [2, 0, 1])
    result = verify_tree(tree, target, "deterministic", torch.tensor([0.6, 0.5], dtype=torch.float64), 0.5)
    assert result == TreeResult([1, 2], [2], "bonus")


@st.composite
def tree_cases(draw) -> TreeCase:
    mode = draw(st.sampled_from(SIBLING_MODES))
    uniform = st.floats(0.0, 1.0, exclude_max=True)
    return build_case(mode, lambda low, high: draw(st.integers(low, high)), lambda: draw(uniform),
                      draw(st.sampled_from([torch.float32, torch.float64])))


@settings(max_examples=100, deadline=None)
@given(case=tree_cases())
def test_float_matches_exact_on_arbitrary_trees(case):
    assume(not case.near_a_tie())
    result = case.run_float()
    assert result == case.run_exact()
    assert_invariants(case, result)


# --- exact losslessness ------------------------------------------------------------------------------

def toy_model(seed: int, keep_top: int | None = None, vocab: int = 3) -> ToyModel:
    """A deterministic prefix -> distribution map of small integer weights (some zero) from a keyed RNG.

    keep_top=k zeroes all but the k most likely tokens (lowest id on ties), like a top-k filter.
    """
    def next_token_distribution(prefix: tuple[int, ...]) -> list[F]:
        rng = random.Random(f"{seed}:{prefix}")
        weights = [rng.choice([0, 1, 2, 3, 5]) for _ in range(vocab)]
        if not any(weights):
            weights[rng.randrange(vocab)] = 1
        if keep_top is not None:
            kept = sorted(range(vocab), key=lambda t: (-weights[t], t))[:keep_top]
            weights = [w if t in kept else 0 for t, w in enumerate(weights)]
        return [F(w, sum(weights)) for w in weights]
    return next_token_distribution


MODEL_PAIRS = {  # (target, draft): different functions of the prefix, zeros in both
    "random": (toy_model(1), toy_model(2)),
    "top_k_target": (toy_model(3, keep_top=2), toy_model(4)),
    "top_k_both": (toy_model(5, keep_top=2), toy_model(6, keep_top=1)),
}
BRANCHINGS = [[1], [2], [3], [2, 2], [3, 1], [1, 2]]
LENGTH = 3


def test_toy_models_have_zeros_and_differ():
    prefixes = [(), (0,), (1,), (2,), (0, 1), (2, 2)]
    for target, draft in MODEL_PAIRS.values():
        assert any(0 in target(prefix) for prefix in prefixes) and any(0 in draft(prefix) for prefix in prefixes)
        assert any(target(prefix) != draft(prefix) for prefix in prefixes)


@pytest.mark.parametrize("mode", SIBLING_MODES)
@pytest.mark.parametrize("branching", BRANCHINGS, ids=str)
@pytest.mark.parametrize("pair", MODEL_PAIRS)
def test_tree_rounds_have_exactly_the_target_distribution(mode, branching, pair):
    target, draft = MODEL_PAIRS[pair]
    assert tree_spec_sequence_distribution(target, draft, branching, mode, LENGTH) == \
        target_sequence_distribution(target, LENGTH)


def test_lossless_after_a_prefix():
    target, draft = MODEL_PAIRS["random"]
    for mode in SIBLING_MODES:
        assert tree_spec_sequence_distribution(target, draft, [2, 2], mode, 2, prefix=(2, 0)) == \
            target_sequence_distribution(target, 2, prefix=(2, 0))


@pytest.mark.parametrize("mode", SIBLING_MODES)
def test_every_sibling_set_reconstructs_p_on_average_over_draws(mode):
    # The one-node statement behind losslessness: sum over draws of P(draw) * (accepted + recovered) = p.
    rng = random.Random(mode)
    for _ in range(10):
        p, q = [toy_model(rng.random(), vocab=4)(()) for _ in range(2)]
        for count in range(1, 4):
            total = [F(0)] * 4
            for siblings, draw_mass in sibling_draws(q, count, mode).items():
                accepted, recovered = sibling_outcomes(p, q, siblings, mode)
                assert sum(accepted) + sum(recovered) == 1
                for token, mass in zip(siblings, accepted):
                    total[token] += draw_mass * mass
                total = [t + draw_mass * r for t, r in zip(total, recovered)]
            assert total == p, (mode, p, q, count)


def test_exact_module_docstring_examples_hold():
    assert doctest.testmod(exact).failed == 0


def test_sibling_draws_follow_their_mode():
    q = [F(1, 2), F(1, 3), F(1, 6), F(0)]
    iid = sibling_draws(q, 2, "iid")
    assert iid[(0, 0)] == F(1, 4) and iid[(1, 2)] == F(1, 18) and sum(iid.values()) == 1 and len(iid) == 9
    without = sibling_draws(q, 2, "without_replacement")
    assert without[(0, 1)] == F(1, 2) * F(1, 3) / F(1, 2) and (0, 0) not in without and sum(without.values()) == 1
    assert set(sibling_draws(q, 5, "without_replacement")) == {(0, 1, 2), (0, 2, 1), (1, 0, 2), (1, 2, 0),
                                                                (2, 0, 1), (2, 1, 0)}  # only 3 have mass
    assert sibling_draws([F(1, 4), F(1, 2), F(1, 4)], 2, "deterministic") == {(1, 0): 1}  # tie: lowest id


@pytest.mark.parametrize("mode", ["iid", "without_replacement"])
def test_a_one_child_per_node_tree_is_a_chain(mode):
    target, draft = MODEL_PAIRS["random"]
    for prefix in [(), (1,), (2, 0)]:
        for depth in [1, 3]:
            assert tree_round_outcomes(prefix, target, draft, [1] * depth, mode) == \
                chain_round_outcomes(prefix, target, draft, depth)


def test_a_deterministic_one_child_tree_is_a_greedy_draft_chain():
    target, draft = MODEL_PAIRS["random"]
    assert tree_round_outcomes((), target, draft, [1, 1], "deterministic") == \
        chain_round_outcomes((), target, draft, 2, greedy_draft=True)


@pytest.mark.parametrize("mode", ["iid", "without_replacement"])
def test_draft_equal_to_target_accepts_the_first_child_every_time(mode):
    target, _ = MODEL_PAIRS["random"]
    outcomes = tree_round_outcomes((), target, target, [3, 2], mode)
    assert sum(outcomes.values()) == 1 and all(len(tokens) == 3 for tokens in outcomes)


# --- teeth: known mistakes must break exact losslessness ---------------------------------------------

def sibling_outcomes_skipping_duplicates(p, q, siblings, mode):
    """BROKEN (iid): a sibling whose token was already tried (and so rejected) is skipped, p unchanged."""
    first_seen = [i for i, token in enumerate(siblings) if token not in siblings[:i]]
    accepted_first_seen, recovered = sibling_outcomes(p, q, [siblings[i] for i in first_seen], mode)
    accepted = [F(0)] * len(siblings)
    for i, mass in zip(first_seen, accepted_first_seen):
        accepted[i] = mass
    return accepted, recovered


def sibling_outcomes_recovering_from_p(p, q, siblings, mode):
    """BROKEN: when every sibling is rejected the recovered token comes from p, not from the residual."""
    accepted, recovered = sibling_outcomes(p, q, siblings, mode)
    all_rejected = sum(recovered, F(0))
    return accepted, [all_rejected * pt for pt in p]


@pytest.mark.parametrize("mode, broken, branching", [
    ("iid", sibling_outcomes_skipping_duplicates, [2]),
    ("iid", sibling_outcomes_skipping_duplicates, [3]),
    ("iid", sibling_outcomes_skipping_duplicates, [2, 2]),
    ("iid", sibling_outcomes_recovering_from_p, [2]),
    ("iid", sibling_outcomes_recovering_from_p, [2, 2]),
    ("without_replacement", sibling_outcomes_recovering_from_p, [2]),
    ("without_replacement", sibling_outcomes_recovering_from_p, [2, 2]),
    # Not [3] here: with every token of V = 3 a child, some child is always accepted, nothing is recovered.
    ("deterministic", sibling_outcomes_recovering_from_p, [2]),
    ("deterministic", sibling_outcomes_recovering_from_p, [2, 2]),
], ids=lambda value: value.__name__.removeprefix("sibling_outcomes_") if callable(value) else str(value))
def test_known_mistakes_are_not_lossless(monkeypatch, mode, broken, branching):
    target, draft = MODEL_PAIRS["random"]
    expected = target_sequence_distribution(target, LENGTH)
    assert tree_spec_sequence_distribution(target, draft, branching, mode, LENGTH) == expected
    monkeypatch.setattr(exact, "sibling_outcomes", broken)  # the enumerator looks it up at call time
    wrong = tree_spec_sequence_distribution(target, draft, branching, mode, LENGTH)
    assert sum(wrong.values()) == 1  # still a distribution, just not the target's
    assert wrong != expected
