"""A small draft model proposing a chain or a tree, with its own KV cache.

Its cache follows the committed path like the target's. For chains (and static trees, whose main
path is a chain) it keeps the committed context plus the drafts it fed: after a round that accepted a
of K chain drafts it keeps x_1..x_min(a, K-1) (x_K was never fed; a rejected draft is dropped even if
the recovered token is the same id), and the next propose feeds whatever committed tokens it has not
yet seen, starting with the previous round's recovered or bonus token. Dynamic trees feed whole levels
with a tree mask; their staged nodes are dropped right after proposing and the accepted ones are
re-fed next round with the new token (one forward either way). Dynamic trees rank nodes by acceptance
rates learned from the drafter's earlier rounds (``AcceptanceCalibration``).
"""

from __future__ import annotations

import math
import time

import torch

from verispec.config import SamplingParams, SiblingMode, TreeShape
from verispec.drafters.base import DrafterBase, Proposal, common_prefix_length, head_args
from verispec.models.llama import LlamaForCausalLM
from verispec.sampling import draw_draft, logits_to_probs, sample_from
from verispec.tree import AcceptanceCalibration, TokenTree, path_nodes

BACKLOG_TOKENS = 2  # a chain round leaves at most x_K and the bonus or recovered token unseen


class DraftModelDrafter(DrafterBase):
    def __init__(self, model: LlamaForCausalLM, max_len: int | None = None, vocab_limit: int | None = None):
        self.model = model
        self.vocab_limit = vocab_limit  # draft only ids < N (``LlamaForCausalLM.logits``); None: all
        self.max_len = max_len or model.config.max_context
        self.max_context = model.config.max_context
        self.cache = model.new_cache(1, self.max_len)
        self.seen: list[int] = []  # tokens whose KV is committed in self.cache
        # Seconds the last propose spent reading this request's prompt (the first read since reset),
        # and on a later backlog (tokens committed while speculation was off): more than the 1-2
        # unseen tokens a speculative round leaves behind; read_tokens: how many tokens that was.
        self.prompt_s = self.backlog_s = 0.0
        self.read_tokens = 0
        # Dynamic trees: acceptance by draft probability and sibling rank, kept across requests, and the
        # last tree's candidates until its round is committed.
        self.calibration: AcceptanceCalibration | None = None
        self._pending_tree: tuple[int, list, set[int]] | None = None

    def reset(self) -> None:
        self.cache.reset()
        self.seen = []
        self._pending_tree = None
        self.prompt_s = self.backlog_s = 0.0
        self.read_tokens = 0

    # ---- chains --------------------------------------------------------------------------------------

    def propose(self, context: list[int], num_drafts: int, sampling: SamplingParams,
                generator: torch.Generator) -> Proposal:
        num_drafts = max(0, min(num_drafts, self.max_len - len(context)))
        tokens, probs = [], []
        logits = self._catch_up(context) if num_drafts else None
        for step in range(num_drafts):
            if step:
                logits = self._feed([tokens[-1]])
            token, step_probs = draw_draft(logits, sampling, generator)
            tokens.append(token)
            if step_probs is not None:
                probs.append(step_probs)
        return Proposal(torch.tensor(tokens, dtype=torch.long), torch.stack(probs) if probs else None)

    # ---- trees ---------------------------------------------------------------------------------------

    def propose_tree(self, context: list[int], shape: TreeShape, mode: SiblingMode, sampling: SamplingParams,
                     generator: torch.Generator) -> Proposal:
        """Draft a tree of ``shape``; children drawn per ``mode`` (deterministic: top-k of the draft's
        logits as point masses; iid / without_replacement: sampled from the transformed q)."""
        if sampling.greedy:
            mode = "deterministic"  # q is a point mass: only top-k children make sense
        if shape.dynamic:
            return self._propose_dynamic(context, shape, sampling.guide)
        return static_tree(context[-1], shape, mode, sampling, generator, self._catch_up(context),
                           lambda token: self._feed([token]))

    def _propose_dynamic(self, context: list[int], shape: TreeShape, guide=None) -> Proposal:
        """Expand the ``branching`` best nodes per level, then keep the budget's best nodes; a node's
        score is the log of its path's calibrated acceptance (``AcceptanceCalibration``), learned from
        earlier rounds of this drafter, so depth wins where the draft's top token is reliably accepted."""
        base = len(context)
        if self.calibration is None or self.calibration.ranks != shape.branching:
            self.calibration = AcceptanceCalibration(shape.branching)
        root_probs = torch.softmax(self._catch_up(context).float(), -1)
        # Pool of candidate nodes: (parent pool index, token, cumulative log score, depth, draft prob, rank).
        pool: list[tuple[int, int, float, int, float, int]] = [(-1, context[-1], 0.0, 0, 1.0, 0)]
        frontier, frontier_probs = [0], [root_probs]
        staged: list[int] = []  # pool indices fed into the draft cache this round, in slot order

        def child(node: int, token: int, prob: float, rank: int) -> tuple:
            score = pool[node][2] + math.log(max(self.calibration.rate(prob, rank), 1e-9))
            return (node, token, score, pool[node][3] + 1, prob, rank)

        for step in range(shape.depth):
            candidates = expand_level(pool, frontier, frontier_probs, shape.branching, guide, child)
            if step == shape.depth - 1 or not candidates:
                break
            frontier = sorted(candidates, key=lambda i: -pool[i][2])[:shape.branching]
            frontier_probs = self._feed_level(frontier, pool, staged)
            staged += frontier
        self.cache.set_length(0, base)  # drop the staged nodes; accepted ones are re-fed next round
        self.seen = self.seen[:base]
        order = best_pool_nodes(pool, shape.num_drafts)
        self._pending_tree = (base, pool, set(order))
        return pool_tree_proposal(pool, order)

    def _learn_from_tree(self, context: list[int]) -> None:
        """After a dynamic tree's round: every candidate child of each node on the accepted path (kept
        in the tree or not) was accepted iff its token is the one committed after that node."""
        base, pool, kept = self._pending_tree
        self._pending_tree = None
        children: dict[int, list[int]] = {}
        for index, entry in enumerate(pool[1:], start=1):
            children.setdefault(entry[0], []).append(index)
        node, position = 0, base
        while node in kept and position < len(context):
            committed, following = context[position], None
            for child in children.get(node, []):
                accepted = pool[child][1] == committed
                self.calibration.observe(pool[child][4], pool[child][5], accepted)
                if accepted:
                    following = child
            if following is None:
                break
            node, position = following, position + 1

    def _feed_level(self, frontier: list[int], pool, staged: list[int]) -> list[torch.Tensor]:
        """Feed frontier nodes; each sees the committed context, its staged ancestors and itself."""
        mask, depths = level_mask(pool, frontier, staged)
        logits = self.model.forward(torch.tensor([[pool[n][1] for n in frontier]]), self.cache,
                                    tree_mask=mask, depths=depths, staged=len(staged),
                                    **head_args(self.vocab_limit))[0].cpu()
        self.cache.commit(0, len(frontier))
        return list(torch.softmax(logits.float(), -1))

    # ---- cache bookkeeping -------------------------------------------------------------------------

    def _catch_up(self, context: list[int]) -> torch.Tensor:
        """Feed the committed tokens not yet seen; logits after the last one."""
        assert context[:len(self.seen)] == self.seen, "draft cache diverged from the committed context"
        unseen, fresh = context[len(self.seen):], not self.seen
        began = time.perf_counter()
        logits = self._feed(unseen)
        long = len(unseen) > BACKLOG_TOKENS
        seconds = time.perf_counter() - began if long else 0.0
        self.prompt_s, self.backlog_s = (seconds, 0.0) if fresh else (0.0, seconds)
        self.read_tokens = len(unseen) if long else 0
        return logits

    def unread(self, context: list[int]) -> int:
        """The committed tokens ``_catch_up`` would feed beyond the last (its cache keeps a prefix of
        ``context``, ``commit`` rolls it back to one). A draft with another tokenizer counts in the
        target's tokens: an estimate of its own."""
        return max(0, len(context) - len(self.seen) - 1)

    def _feed(self, tokens: list[int]) -> torch.Tensor:
        logits = self.model.forward(torch.tensor([tokens]), self.cache, last_only=True, **head_args(self.vocab_limit))[0, -1].cpu()
        self.cache.commit(0, len(tokens))
        self.seen.extend(tokens)
        return logits

    def commit(self, context: list[int]) -> None:
        """``context`` is now the committed sequence: keep only the KV of its tokens we have seen."""
        if self._pending_tree is not None:
            self._learn_from_tree(context)
        # Always leave the last committed token unseen: its logits are what the next propose needs.
        keep = min(common_prefix_length(self.seen, context), len(context) - 1)
        self.seen = self.seen[:keep]
        self.cache.set_length(0, keep)


def pool_path(pool: list[tuple], node: int) -> list[int]:
    """The tokens from the root's child down to pool entry ``node`` (entries: (parent, token, ...))."""
    tokens = []
    while node > 0:
        tokens.append(pool[node][1])
        node = pool[node][0]
    return tokens[::-1]


def expand_level(pool: list[tuple], frontier: list[int], frontier_probs: list[torch.Tensor], branching: int,
                 guide, child) -> list[int]:
    """Append to ``pool`` the ``branching`` most probable children of each frontier node (probs (V,) each;
    with a ``guide``, only tokens its grammar allows after the node); their pool indices, in order.

    ``child(node, token, prob, rank)`` makes a child's pool entry: (parent, token, score, depth, ...)."""
    candidates = []
    for node, probs in zip(frontier, frontier_probs):
        if guide is not None:  # children only among what the grammar allows after the node
            probs = probs * guide.mask_after(pool_path(pool, node))
        values, ids = probs.topk(branching)
        for rank, (prob, token) in enumerate(zip(values.tolist(), ids.tolist())):
            if guide is not None and prob <= 0:
                break
            candidates.append(len(pool))
            pool.append(child(node, token, prob, rank))
    return candidates


def level_mask(pool: list[tuple], frontier: list[int], staged: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Tree mask (len(frontier), len(staged + frontier)) letting each frontier node see its staged
    ancestors and itself, and each node's depth below the root's child (len(frontier),)."""
    own = staged + frontier
    slot = {node: j for j, node in enumerate(own)}
    mask = torch.zeros(len(frontier), len(own), dtype=torch.bool)
    for row, node in enumerate(frontier):
        while node > 0:  # itself and its staged ancestors
            mask[row, slot[node]] = True
            node = pool[node][0]
    depths = torch.tensor([pool[node][3] - 1 for node in frontier])
    return mask, depths


def best_pool_nodes(pool: list[tuple], num_drafts: int) -> list[int]:
    """The root and the ``num_drafts`` best-scored pool entries (ties: shallower, then older), parents first."""
    keep = sorted(range(1, len(pool)), key=lambda i: (-pool[i][2], pool[i][3], i))[:num_drafts]
    return [0] + sorted(keep, key=lambda i: (pool[i][3], i))


def pool_tree_proposal(pool: list[tuple], order: list[int]) -> Proposal:
    """The tree of pool entries ``order`` (parents first, the root at 0) as a deterministic proposal."""
    index = {old: new for new, old in enumerate(order)}
    parents = [-1] + [index[pool[i][0]] for i in order[1:]]
    return _tree_proposal(parents, [pool[i][1] for i in order], {}, 0, deterministic=True)


def static_tree(root: int, shape: TreeShape, mode: SiblingMode, sampling: SamplingParams,
                generator: torch.Generator, logits: torch.Tensor, advance) -> Proposal:
    """A static sN_kK_dD tree grown along its main path: each level's children are drawn (per ``mode``)
    from the main node's draft logits, the first child is the next main node, and ``advance(token)``
    feeds it to the drafter and returns the logits after it. The extra nodes (budget minus depth) widen
    the first levels up to ``branching``."""
    parents, tokens, rows = [-1], [root], {}
    extras, main = shape.num_drafts - shape.depth, 0
    for level in range(1, shape.depth + 1):
        width = 1 + min(shape.branching - 1, extras)
        extras -= width - 1
        if sampling.guide is not None:  # the grammar's mask and penalties after the main path so far
            main_path = [tokens[node] for node in path_nodes(parents, main)]
            logits = sampling.guide.rows_after(main_path).apply(logits)
        children, q = _draw_children(logits, width, mode, sampling, generator)
        if q is not None:
            rows[main] = q
        first = len(tokens)
        parents += [main] * len(children)
        tokens += children
        main = first
        if level < shape.depth:
            logits = advance(tokens[main])
    return _tree_proposal(parents, tokens, rows, logits.shape[-1])


def top_tokens(logits: torch.Tensor, count: int) -> list[int]:
    """The ``count`` highest logits' ids, ties broken towards the lower id (a stable descending sort's
    order) without sorting the vocabulary: only the candidates at or above the count-th value are sorted."""
    values = logits.float()
    count = min(count, values.numel())
    threshold = torch.topk(values, count).values[-1]
    candidates = (values >= threshold).nonzero().flatten()  # ascending ids
    order = torch.sort(values[candidates], descending=True, stable=True).indices
    return candidates[order[:count]].tolist()


def _draw_children(logits: torch.Tensor, width: int, mode: SiblingMode, sampling: SamplingParams,
                   generator: torch.Generator) -> tuple[list[int], torch.Tensor | None]:
    """Child tokens of one node and the q they were drawn from (None for point masses)."""
    if mode == "deterministic":  # never a token at -inf (one a grammar forbids)
        return top_tokens(logits, min(width, max(1, int(torch.isfinite(logits).sum())))), None
    q = logits_to_probs(logits, sampling)
    if mode == "iid":
        return [sample_from(q, generator) for _ in range(width)], q
    remaining, children = q.clone(), []
    for _ in range(min(width, int((q > 0).sum()))):
        token = sample_from(remaining, generator)
        children.append(token)
        remaining[token] = 0
    return children, q


def _tree_proposal(parents: list[int], tokens: list[int], rows: dict[int, torch.Tensor], vocab: int,
                   deterministic: bool = False) -> Proposal:
    draft_probs = None
    if rows and not deterministic:
        draft_probs = torch.zeros(len(parents), vocab)
        for node, q in rows.items():
            draft_probs[node] = q
    tree = TokenTree(parents=parents, tokens=tokens, draft_probs=draft_probs)
    return Proposal(torch.tensor(tokens[1:], dtype=torch.long), None, tree)

