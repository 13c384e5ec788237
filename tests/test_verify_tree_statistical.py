"""Statistical losslessness of the float tree verifier: drafted and verified rounds follow the target.

Toy setting: a target and a drafter over V tokens whose next-token distributions depend on the tokens
emitted so far in the round (p_root = p(.), p(.|y1), p(.|y1, y2)), built from random logits through
``logits_to_probs`` with the same SamplingParams for both, so transforms that zero tokens (top-k, top-p,
min-p) are covered. Each round drafts a tree with torch from the drafter, per mode (iid draws, draws
without replacement, or the top-k tokens), and verifies it with ``verify_tree`` and uniforms from a seeded
torch.Generator. Over N rounds:

(a) the first emitted token y1 must follow p_root;
(b) the pair (y1, y2) must follow p(y1) p(y2|y1), where y2 is the round's second token when it emitted
    at least two, and otherwise a fresh draw from p(.|y1) (what the next round would produce, by (a)
    applied after y1). This is the lossless statement for two tokens; it also sees the bonus token.

A sample passes when the chi-square p-value exceeds 1e-4 and the total variation is below 3 sqrt(C / N)
for C cells (see stats_helpers: a correct sampler fails with probability < 1e-4 + 1e-10). Every seed is
fixed, so the outcome is deterministic. Two known mistakes must fail at the same N: iid verification that
skips a sibling whose token was already rejected, and recovering from p instead of the residual.

verify_tree is a per-round Python walk (a few hundred microseconds), so N rounds cost seconds. The default
run takes N = 5,000 and six settings, each mode on a one-level and a two-level tree with the four
transforms spread over them; VERISPEC_FULL_STATS=1 takes N = 20,000 and all 24 (transform, shape, mode)
settings (minutes). Mistakes are tested at the same N as the correct verifier, on the same draws.
"""

from __future__ import annotations

import functools
import itertools
import os
import zlib
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from stats_helpers import FitResult, describe, fit_to_distribution
from verispec.config import SamplingParams
from verispec.sampling import logits_to_probs, sample, sample_batch
from verispec.tree import TokenTree
from verispec.verify.tree import SIBLING_MODES, TreeResult, verify_tree

FULL_RUN = bool(os.environ.get("VERISPEC_FULL_STATS"))
NUM_ROUNDS = 20_000 if FULL_RUN else 5_000
VOCAB = 4
TRANSFORMS = {"temperature": SamplingParams(temperature=0.7), "top_k": SamplingParams(top_k=2),
              "top_p": SamplingParams(top_p=0.8), "min_p": SamplingParams(min_p=0.2)}
SHAPES = {"one_level": (2,), "two_level": (2, 2)}  # children per node at each depth


# --- the toy target and drafter ----------------------------------------------------------------------

@dataclass(frozen=True)
class ToyPair:
    """Next-token distributions after 0, 1 and 2 tokens of the round: (V,), (V, V), (V, V, V) each."""

    target: tuple[torch.Tensor, ...]
    draft: tuple[torch.Tensor, ...]


def make_pair(kind: str) -> ToyPair:
    """Random logits through one transform (a TRANSFORMS key), or the hand-made pair."""
    if kind == "hand":
        return hand_pair()
    generator = torch.Generator().manual_seed(zlib.crc32(kind.encode()))
    target, draft = [], []
    for depth in range(3):
        shape = (VOCAB,) * (depth + 1)
        target_logits = torch.randn(shape, generator=generator)
        # A drafter resembles its target: its logits are the target's plus noise.
        draft_logits = target_logits + 0.5 * torch.randn(shape, generator=generator)
        target.append(logits_to_probs(target_logits, TRANSFORMS[kind]).double())
        draft.append(logits_to_probs(draft_logits, TRANSFORMS[kind]).double())
    return ToyPair(tuple(target), tuple(draft))


def hand_pair() -> ToyPair:
    """p and q far apart at the root: q mostly proposes token 0, which p rarely wants, and never token 3.

    iid siblings then often repeat token 0, and token 3 comes only from recovery, so skipping the p update
    for a repeated token shifts p_root by TV 0.12 (exact, from verify/exact.py) with two children.
    """
    root_target, root_draft = torch.tensor([0.1, 0.3, 0.3, 0.3]), torch.tensor([0.6, 0.2, 0.2, 0.0])
    after_first = torch.stack([torch.tensor([0.7, 0.1, 0.1, 0.1]).roll(token) for token in range(VOCAB)])
    uniform = torch.full((VOCAB,) * 3, 1 / VOCAB)
    return ToyPair((root_target.double(), after_first.double(), uniform.double()),
                   (root_draft.double(), torch.full((VOCAB, VOCAB), 1 / VOCAB).double(), uniform.double()))


# --- drafting a tree per round -----------------------------------------------------------------------

def draw_children(draft_probs: torch.Tensor, count: int, mode: str, generator: torch.Generator) -> torch.Tensor:
    """Children tokens (M, count) for M nodes with draft rows (M, V), in draw order; -1 where none is left.

    iid: independent draws; without_replacement: sequential draws with earlier ones removed and the rest
    renormalised (stopping when no token with mass is left); deterministic: top-count (lowest id on ties).
    """
    if mode == "iid":
        return torch.multinomial(draft_probs, count, replacement=True, generator=generator)
    if mode == "deterministic":
        return torch.sort(draft_probs, dim=-1, descending=True, stable=True).indices[:, :count]
    remaining, drawn = draft_probs.clone(), []
    for _ in range(count):
        exhausted = remaining.sum(-1) == 0
        token = torch.multinomial(torch.where(exhausted[:, None], 1.0, remaining), 1, generator=generator)[:, 0]
        remaining.scatter_(1, token[:, None], 0.0)
        drawn.append(torch.where(exhausted, -1, token))
    return torch.stack(drawn, dim=1)


@dataclass(frozen=True)
class DraftedRounds:
    """N drafted trees in one fixed layout: root, then the level-1 slots, then the level-2 slots.

    A slot whose token is -1 (without replacement ran out of tokens) is absent from that round's tree.
    """

    parents: list[int]  # per slot, layout-wide
    tokens: torch.Tensor  # (N, slots); the root's token is irrelevant and set to 0
    target_rows: torch.Tensor  # (N, slots, V): the target distribution after each slot
    draft_rows: torch.Tensor  # (N, slots, V)
    uniforms: torch.Tensor  # (N, slots - 1) float64
    final_uniforms: torch.Tensor  # (N,) float64


def draft_rounds(pair: ToyPair, shape: tuple[int, ...], mode: str, generator: torch.Generator) -> DraftedRounds:
    n = NUM_ROUNDS
    parents, tokens = [-1], [torch.zeros(n, 1, dtype=torch.long)]
    target_rows, draft_rows = [pair.target[0].expand(n, 1, VOCAB)], [pair.draft[0].expand(n, 1, VOCAB)]
    level_slots, level_history = [0], torch.zeros(n, 1, 0, dtype=torch.long)  # (N, slots at level, depth)
    for depth, count in enumerate(shape):
        children = draw_children(draft_rows[-1].reshape(-1, VOCAB), count, mode, generator)
        children = children.reshape(n, -1)  # (N, slots at this level * count)
        history = torch.cat([level_history.repeat_interleave(count, dim=1), children.clamp(min=0)[..., None]], -1)
        first_slot = len(parents)
        parents += [slot for slot in level_slots for _ in range(count)]
        level_slots = list(range(first_slot, len(parents)))
        tokens.append(children)
        target_rows.append(pair.target[depth + 1][tuple(history.unbind(-1))])
        draft_rows.append(pair.draft[depth + 1][tuple(history.unbind(-1))])
        level_history = history
    slots = len(parents)
    return DraftedRounds(parents, torch.cat(tokens, 1), torch.cat(target_rows, 1), torch.cat(draft_rows, 1),
                         torch.rand(n, slots - 1, generator=generator, dtype=torch.float64),
                         torch.rand(n, generator=generator, dtype=torch.float64))


def round_inputs(rounds: DraftedRounds, i: int, tokens: list[int], uniforms: list[float]):
    """Round i's tree, target rows and uniforms, dropping absent slots (and so their children)."""
    if min(tokens) >= 0:  # every slot present: the layout is the tree
        return TokenTree(rounds.parents, tokens, rounds.draft_rows[i]), rounds.target_rows[i], uniforms
    present = [0]
    for slot in range(1, len(tokens)):
        if tokens[slot] >= 0 and rounds.parents[slot] in present:
            present.append(slot)
    renumber = {slot: node for node, slot in enumerate(present)}
    tree = TokenTree([renumber.get(rounds.parents[s], -1) for s in present], [tokens[s] for s in present],
                     rounds.draft_rows[i, present])
    return tree, rounds.target_rows[i, present], [uniforms[s - 1] for s in present[1:]]


# --- the two token statistics ------------------------------------------------------------------------

@dataclass(frozen=True)
class Simulation:
    pair: ToyPair
    first: np.ndarray  # (N,) y1
    second: np.ndarray  # (N,) y2: the round's second token, or a fresh draw from p(.|y1)
    recovered_share: float  # share of rounds that ended with a recovered token


@functools.cache
def simulate(kind: str, shape: str, mode: str, verifier_name: str = "verify_tree") -> Simulation:
    """NUM_ROUNDS rounds of one setting; the drafts and uniforms depend on the setting, not the verifier."""
    verifier = VERIFIERS[verifier_name]
    pair = make_pair(kind)
    generator = torch.Generator().manual_seed(zlib.crc32(f"{kind}/{shape}/{mode}".encode()))
    rounds = draft_rounds(pair, SHAPES[shape], mode, generator)
    results = []
    all_tokens, all_uniforms = rounds.tokens.tolist(), rounds.uniforms.tolist()
    for i, final_uniform in enumerate(rounds.final_uniforms.tolist()):
        tree, target_rows, uniforms = round_inputs(rounds, i, all_tokens[i], all_uniforms[i])
        results.append(verifier(tree, target_rows, mode, uniforms, final_uniform))
    first = torch.tensor([result.tokens[0] for result in results])
    fresh_second = sample_batch(pair.target[1][first], torch.rand(NUM_ROUNDS, generator=generator,
                                                                  dtype=torch.float64))
    second = torch.tensor([result.tokens[1] if len(result.tokens) >= 2 else -1 for result in results])
    second = torch.where(second >= 0, second, fresh_second)
    recovered_share = float(np.mean([result.last_kind == "recovered" for result in results]))
    return Simulation(pair, first.numpy(), second.numpy(), recovered_share)


def first_token_fit(simulation: Simulation) -> FitResult:
    return fit_to_distribution(simulation.first, simulation.pair.target[0].numpy())


def token_pair_fit(simulation: Simulation) -> FitResult:
    joint = simulation.pair.target[0][:, None] * simulation.pair.target[1]  # (V, V): p(y1) p(y2 | y1)
    return fit_to_distribution(simulation.first * VOCAB + simulation.second, joint.reshape(-1).numpy())


# --- deliberately broken verifiers -------------------------------------------------------------------

def verify_tree_skipping_duplicates(tree: TokenTree, target_probs, mode, uniforms, final_uniform) -> TreeResult:
    """BROKEN (iid): a sibling whose token was already tried (so rejected) is skipped; p is not updated.

    Same as verifying the tree with every later duplicate sibling (and its subtree) removed.
    """
    kept = [0]
    for node in range(1, len(tree.parents)):
        parent = tree.parents[node]
        earlier_twin = any(tree.parents[k] == parent and tree.tokens[k] == tree.tokens[node] for k in kept)
        if parent in kept and not earlier_twin:
            kept.append(node)
    renumber = {node: new for new, node in enumerate(kept)}
    pruned = TokenTree([renumber.get(tree.parents[k], -1) for k in kept], [tree.tokens[k] for k in kept],
                       tree.draft_probs[kept])
    result = verify_tree(pruned, target_probs[kept], mode, [uniforms[k - 1] for k in kept[1:]], final_uniform)
    return TreeResult(result.tokens, [kept[node] for node in result.accepted_nodes], result.last_kind)


def verify_tree_recovering_from_p(tree: TokenTree, target_probs, mode, uniforms, final_uniform) -> TreeResult:
    """BROKEN: when every child of a node is rejected, the recovered token is drawn from p, not the residual."""
    result = verify_tree(tree, target_probs, mode, uniforms, final_uniform)
    if result.last_kind == "bonus":
        return result
    node = result.accepted_nodes[-1] if result.accepted_nodes else 0
    return TreeResult(result.tokens[:-1] + [sample(target_probs[node], final_uniform)], result.accepted_nodes,
                      "recovered")


VERIFIERS = {"verify_tree": verify_tree, "skipping_duplicates": verify_tree_skipping_duplicates,
             "recovering_from_p": verify_tree_recovering_from_p}


# --- tests -------------------------------------------------------------------------------------------

# Each mode on both shapes, every transform at least once; all chosen so that rounds end both ways
# (recovered and bonus) often enough to matter.
DEFAULT_SETTINGS = [("temperature", "one_level", "iid"), ("top_p", "one_level", "without_replacement"),
                    ("min_p", "one_level", "deterministic"), ("top_k", "two_level", "iid"),
                    ("min_p", "two_level", "without_replacement"), ("top_p", "two_level", "deterministic")]
SETTINGS = list(itertools.product(TRANSFORMS, SHAPES, SIBLING_MODES)) if FULL_RUN else DEFAULT_SETTINGS


@pytest.mark.parametrize("kind, shape, mode", SETTINGS, ids=["-".join(setting) for setting in SETTINGS])
def test_first_token_and_token_pair_follow_the_target(kind, shape, mode):
    simulation = simulate(kind, shape, mode)
    first, joint = first_token_fit(simulation), token_pair_fit(simulation)
    assert first.passes, "first token: " + describe(first)
    assert joint.passes, "token pair: " + describe(joint)


@pytest.mark.parametrize("kind, shape, mode", DEFAULT_SETTINGS,
                         ids=["-".join(setting) for setting in DEFAULT_SETTINGS])
def test_default_settings_end_rounds_both_ways(kind, shape, mode):
    # Guards the test above against vacuity: both the recovered and the bonus branch carry real weight.
    assert 0.05 < simulate(kind, shape, mode).recovered_share < 0.95


MISTAKES = [("hand", "one_level", "iid", "skipping_duplicates"),
            ("temperature", "one_level", "iid", "recovering_from_p"),
            ("min_p", "two_level", "without_replacement", "recovering_from_p"),
            ("top_p", "two_level", "deterministic", "recovering_from_p")]


@pytest.mark.parametrize("kind, shape, mode, broken", MISTAKES, ids=["-".join(mistake) for mistake in MISTAKES])
def test_known_mistakes_fail_the_statistical_check(kind, shape, mode, broken):
    simulation = simulate(kind, shape, mode, broken)
    first, joint = first_token_fit(simulation), token_pair_fit(simulation)
    assert not (first.passes and joint.passes), describe(first) + "; " + describe(joint)


def test_a_mistake_below_the_root_is_seen_only_by_the_pair_check():
    # Top-p leaves p_root two tokens, and the two deterministic children are exactly those, so the root
    # never recovers and y1 is right; recovering from p after y1 is wrong, which only (y1, y2) shows.
    simulation = simulate("top_p", "two_level", "deterministic", "recovering_from_p")
    first, joint = first_token_fit(simulation), token_pair_fit(simulation)
    assert first.passes, describe(first)
    assert joint.pvalue < 1e-10, describe(joint)


def test_the_hand_pair_passes_with_the_correct_verifier():
    simulation = simulate("hand", "one_level", "iid")
    for fit in (first_token_fit(simulation), token_pair_fit(simulation)):
        assert fit.passes, describe(fit)
