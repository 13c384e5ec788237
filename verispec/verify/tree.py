"""Tree verification in three sibling modes (docs/algorithms.md). Pure functions.

Walk from the root u: ``p`` starts as the target distribution after u. Try u's children in draw order;
on acceptance emit the child and descend (p becomes the target distribution after it); when every
child is rejected emit a *recovered* token from the current p (which by then is the residual); at an
accepted leaf emit a *bonus* token from the target distribution after it. How p (and q) change after a
rejected child x depends on how the siblings were drawn from the drafter's q after u:

- ``iid`` (SpecInfer): accept with min(1, p(x)/q(x)); reject -> p = norm(max(0, p - q)); q fixed.
  Duplicate tokens are separate nodes and each rejection updates p again.
- ``without_replacement`` (Sequoia): q_cur starts at q; accept with min(1, p(x)/q_cur(x));
  reject -> p = norm(max(0, p - q_cur)), then q_cur[x] = 0 and renormalise.
- ``deterministic`` (top-k children, EAGLE-2): q is a point mass; accept with p(x);
  reject -> p[x] = 0 and renormalise.

Example: root with children A (0) and B (1), deterministic, p_root = (0.5, 0.3, 0.2) (V = 3), draws
u = (0.6, 0.5): A is rejected (0.6 >= 0.5), p becomes (0, 0.6, 0.4); B is accepted (0.5 < 0.6); B is a
leaf, so a bonus token follows from the target distribution after B.

Uniforms are indexed by node: node i's test uses ``uniforms[i - 1]``, so a round replays exactly from
its draws whatever path the walk takes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from verispec.config import SIBLING_MODES, SiblingMode
from verispec.sampling import sample
from verispec.tree import TokenTree


@dataclass(frozen=True)
class TreeResult:
    tokens: list[int]  # accepted path's tokens, then one recovered or bonus token
    accepted_nodes: list[int]  # node indices of the accepted path (root excluded)
    last_kind: Literal["recovered", "bonus"]

    @property
    def num_accepted(self) -> int:
        return len(self.accepted_nodes)


def verify_tree(tree: TokenTree, target_probs: torch.Tensor, mode: SiblingMode,
                uniforms: torch.Tensor | None = None, final_uniform: float | None = None,
                generator: torch.Generator | None = None) -> TreeResult:
    """Verify a drafted tree.

    tree: parents/tokens (N+1 nodes, node 0 the root) and ``draft_probs`` (N+1, V), row i the draft
    distribution node i's children were drawn from (unused in deterministic mode).
    target_probs: (N+1, V), row i the target distribution of the token after node i.
    uniforms: (N,) in [0, 1), final_uniform in [0, 1); drawn from ``generator`` when omitted.
    """
    assert mode in SIBLING_MODES, mode
    size = len(tree.parents)
    assert target_probs.shape[0] == size, (target_probs.shape, size)
    if mode != "deterministic":
        assert tree.draft_probs is not None and tree.draft_probs.shape == target_probs.shape
    if uniforms is None:
        uniforms = torch.rand(size - 1, generator=generator, dtype=torch.float64)
    if final_uniform is None:
        final_uniform = torch.rand((), generator=generator, dtype=torch.float64).item()
    children = tree.children()
    node, accepted_nodes = 0, []
    while True:
        p = target_probs[node].double()
        if not children[node]:
            return TreeResult(_tokens(tree, accepted_nodes) + [sample(p, final_uniform)], accepted_nodes, "bonus")
        q = tree.draft_probs[node].double().clone() if mode != "deterministic" else None
        chosen = None
        for child in children[node]:
            token, u = tree.tokens[child], float(uniforms[child - 1])
            if mode == "deterministic":
                if u < p[token]:
                    chosen = child
                    break
                p = _renormalised(_without(p, token), fallback=p)
                continue
            assert q[token] > 0, f"drafted token {token} has no mass under the q it was drawn from"
            if u * q[token] < p[token]:  # u < min(1, p(x) / q(x)) without dividing
                chosen = child
                break
            p = _renormalised((p - q).clamp(min=0), fallback=p)
            if mode == "without_replacement":
                q = _renormalised(_without(q, token), fallback=q)
        if chosen is None:
            return TreeResult(_tokens(tree, accepted_nodes) + [sample(p, final_uniform)], accepted_nodes, "recovered")
        accepted_nodes.append(chosen)
        node = chosen


def verify_tree_greedy(tree: TokenTree, target_argmax: list[int]) -> TreeResult:
    """Greedy fast path: with one-hot p (temperature 0) a child is accepted iff its token is the
    target's argmax after its parent, and the recovered / bonus token is that argmax. Identical to
    ``verify_tree`` in any mode on one-hot target rows (tested), without probabilities or uniforms.

    target_argmax: N+1 ids, entry i the argmax of the target's logits after node i.
    """
    assert len(target_argmax) == len(tree.parents)
    children = tree.children()
    node, accepted_nodes = 0, []
    while True:
        best = target_argmax[node]
        chosen = next((child for child in children[node] if tree.tokens[child] == best), None)
        if chosen is None:
            kind = "recovered" if children[node] else "bonus"
            return TreeResult(_tokens(tree, accepted_nodes) + [best], accepted_nodes, kind)
        accepted_nodes.append(chosen)
        node = chosen


def _tokens(tree: TokenTree, nodes: list[int]) -> list[int]:
    return [tree.tokens[n] for n in nodes]


def _without(dist: torch.Tensor, token: int) -> torch.Tensor:
    dist = dist.clone()
    dist[token] = 0
    return dist


def _renormalised(dist: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    # An empty residual needs p <= q everywhere, i.e. p == q, where no rejection can happen; only
    # float noise gets here, and then the previous distribution is the right answer.
    total = dist.sum()
    return dist / total if total > 0 else fallback
