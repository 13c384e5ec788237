"""Token trees compiled once into the buffers one forward pass needs.

Node 0 is the root: the last committed token, fed first. Nodes 1..N are drafts, in parent-first order
(parent[i] < i). Example, a root with two children and one grandchild under the first child:

    >>> tree = TokenTree(parents=[-1, 0, 0, 1], tokens=[7, 3, 5, 9])
    >>> buffers = tree.compile()
    >>> buffers.depths.tolist()
    [0, 1, 1, 2]
    >>> buffers.ancestor_mask.int().tolist()   # row j: the nodes j attends to (ancestors and itself)
    [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]
    >>> buffers.paths                           # root-to-leaf node paths
    [[0, 1, 3], [0, 2]]

Position ids are prefix_len + depth. A chain is the tree with one child per node.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class TreeBuffers:
    ancestor_mask: torch.Tensor  # (N+1, N+1) bool: [j, i] is True iff i is j or an ancestor of j
    depths: torch.Tensor  # (N+1,) int64, root 0
    paths: list[list[int]]  # root-to-leaf node indices
    children: list[list[int]]  # children of each node, in draw order


@dataclass
class TokenTree:
    parents: list[int]  # parents[0] == -1
    tokens: list[int]
    # Draft distribution each node's children were drawn from (row i: after node i), when known.
    draft_probs: torch.Tensor | None = None  # (N+1, V)
    scores: list[float] = field(default_factory=list)  # cumulative draft log-prob per node (builders)
    _buffers: TreeBuffers | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        assert len(self.parents) == len(self.tokens) and self.parents[0] == -1
        assert all(0 <= p < i for i, p in enumerate(self.parents) if i), "parents must precede children"

    @property
    def num_nodes(self) -> int:
        """Draft nodes, excluding the root."""
        return len(self.parents) - 1

    def children(self) -> list[list[int]]:
        kids: list[list[int]] = [[] for _ in self.parents]
        for node, parent in enumerate(self.parents):
            if node:
                kids[parent].append(node)
        return kids

    def compile(self) -> TreeBuffers:
        """The buffers, built on the first call and reused after (a tree is not edited once built)."""
        if self._buffers is None:
            self._buffers = self._build()
        return self._buffers

    def _build(self) -> TreeBuffers:
        size = len(self.parents)
        rows: list[list[bool]] = []  # built in Python, converted once: per-element tensor writes are slow
        depths: list[int] = []
        for node, parent in enumerate(self.parents):
            row = list(rows[parent]) if parent >= 0 else [False] * size
            row[node] = True
            rows.append(row)
            depths.append(depths[parent] + 1 if parent >= 0 else 0)
        mask = torch.tensor(rows, dtype=torch.bool)
        kids = self.children()
        paths = []

        def walk(node: int, path: list[int]) -> None:
            if not kids[node]:
                paths.append(path)
            for child in kids[node]:
                walk(child, path + [child])

        walk(0, [0])
        return TreeBuffers(mask, torch.tensor(depths, dtype=torch.long), paths, kids)

    def pruned(self, max_depth: int) -> "TokenTree":
        """The nodes at depth <= ``max_depth`` (parent-first order kept): a round with fewer tokens left
        to generate than the tree is deep verifies only what it could commit."""
        depths = self.compile().depths.tolist()
        keep = [node for node, depth in enumerate(depths) if depth <= max_depth]
        if len(keep) == len(depths):
            return self
        index = {old: new for new, old in enumerate(keep)}
        return TokenTree([-1] + [index[self.parents[node]] for node in keep[1:]], [self.tokens[node] for node in keep],
                         None if self.draft_probs is None else self.draft_probs[keep])

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root's first child down to ``node`` (root excluded)."""
        return path_nodes(self.parents, node)


def use_tree(shape, room: int) -> bool:
    """Whether a round drafts a tree of ``shape`` (a ``config.TreeShape``) with ``room`` cache positions
    left: only if every node fits; otherwise the round drafts a chain of what is left, verified as exactly."""
    return shape.cache_positions <= room


def path_nodes(parents: list[int], node: int) -> list[int]:
    """Node indices from the root's first child down to ``node`` (root excluded), for a parents list
    (a tree being built, or ``TokenTree.parents``)."""
    path = []
    while node > 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


class AcceptanceCalibration:
    """How often a drafted child is accepted once its parent is reached, by the draft's probability for
    it (10 equal bins) and its sibling rank (0 = the draft's top token), learned from verified rounds.

    A dynamic tree ranks nodes by the product of these along their path rather than by the draft's own
    cumulative probability: a draft whose probabilities are miscalibrated (the embedded draft's top
    token is accepted ~75% of the time at a stated probability well below that) otherwise spends the
    verification budget on siblings where depth would pay. Each (bin, rank) cell starts from the
    draft's own belief (the bin centre) worth ``prior_weight`` observations.

        >>> calibration = AcceptanceCalibration(ranks=2)
        >>> calibration.rate(0.35, 0)              # no data: the bin centre
        0.35
        >>> for _ in range(12):
        ...     calibration.observe(0.35, 0, True)
        >>> round(calibration.rate(0.35, 0), 3)    # (12 + 4 * 0.35) / (12 + 4)
        0.838
    """

    BINS = 10

    def __init__(self, ranks: int, prior_weight: float = 4.0):
        self.ranks, self.prior_weight = ranks, prior_weight
        self.reached = [[0] * self.BINS for _ in range(ranks)]
        self.accepted = [[0] * self.BINS for _ in range(ranks)]

    def _cell(self, prob: float, rank: int) -> tuple[int, int]:
        return min(rank, self.ranks - 1), min(int(prob * self.BINS), self.BINS - 1)

    def rate(self, prob: float, rank: int) -> float:
        """Estimated P(accepted | parent reached) for a child drafted with ``prob`` at ``rank``."""
        r, b = self._cell(prob, rank)
        prior = (b + 0.5) / self.BINS
        return (self.accepted[r][b] + self.prior_weight * prior) / (self.reached[r][b] + self.prior_weight)

    def observe(self, prob: float, rank: int, accepted: bool) -> None:
        r, b = self._cell(prob, rank)
        self.reached[r][b] += 1
        self.accepted[r][b] += int(accepted)

    def observations(self) -> int:
        return sum(map(sum, self.reached))
