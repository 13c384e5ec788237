"""Exact reference implementations over fractions.Fraction: the oracle the float code is tested against.

Distributions are sequences of Fractions indexed by token id. Nothing here is fast; everything here is
obviously the rule (docs/algorithms.md), so the float paths are checked against it.

The worked example of chain verification in docs/algorithms.md:

    >>> p = [F('0.5'), F('0.3'), F('0.2')]; q = [F('0.6'), F('0.1'), F('0.3')]
    >>> m = acceptance_masses(p, q)
    >>> [float(x) for x in m.accepted], float(m.acceptance), [float(x) for x in m.residual]
    ([0.5, 0.1, 0.2], 0.8, [0.0, 1.0, 0.0])
    >>> m.reconstructed == p
    True
    >>> verify_chain_exact([0, 2, 1], [q] * 3, [p] * 4, [F('0.7'), F('0.9'), F('0.2')], F('0.2')).tokens
    [0, 1]
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction as F
from typing import Callable, Sequence

from verispec.verify.chain import ChainResult

Dist = Sequence[F]


@dataclass(frozen=True)
class AcceptanceMasses:
    accepted: list[F]  # min(p, q) per token: mass accepted at this position
    acceptance: F  # sum of accepted
    residual: list[F] | None  # norm(max(0, p - q)); None when acceptance == 1
    reconstructed: list[F]  # accepted + (1 - acceptance) * residual; must equal p


def acceptance_masses(p: Dist, q: Dist) -> AcceptanceMasses:
    accepted = [min(pi, qi) for pi, qi in zip(p, q)]
    alpha = sum(accepted, F(0))
    if alpha < 1:
        residual = [max(pi - qi, F(0)) / (1 - alpha) for pi, qi in zip(p, q)]
        reconstructed = [a + (1 - alpha) * r for a, r in zip(accepted, residual)]
    else:
        residual, reconstructed = None, accepted
    return AcceptanceMasses(accepted, alpha, residual, reconstructed)


def sample_exact(dist: Dist, u: F) -> int:
    """Inverse CDF in token-id order over an (unnormalised) distribution, exactly."""
    assert 0 <= u < 1
    total = sum(dist, F(0))
    cumulative = F(0)
    for token, mass in enumerate(dist):
        cumulative += mass
        if u * total < cumulative:
            return token
    raise ValueError("distribution has no mass")


def residual_exact(p: Dist, q: Dist) -> list[F]:
    raw = [max(pi - qi, F(0)) for pi, qi in zip(p, q)]
    total = sum(raw, F(0))
    return [r / total for r in raw] if total else list(p)


def one_hot(token: int, size: int) -> list[F]:
    return [F(int(i == token)) for i in range(size)]


def verify_chain_exact(draft_tokens: Sequence[int], draft_probs: Sequence[Dist] | None,
                       target_probs: Sequence[Dist], uniforms: Sequence[F], final_uniform: F) -> ChainResult:
    """The chain rule, one draft at a time."""
    vocab = len(target_probs[0])
    for i, token in enumerate(draft_tokens):
        q = draft_probs[i] if draft_probs is not None else one_hot(token, vocab)
        p = target_probs[i]
        assert q[token] > 0 and 0 <= uniforms[i] < 1
        if not uniforms[i] < min(F(1), p[token] / q[token]):
            recovered = sample_exact(residual_exact(p, q), final_uniform)
            return ChainResult(list(draft_tokens[:i]) + [recovered], i, "recovered")
    bonus = sample_exact(target_probs[len(draft_tokens)], final_uniform)
    return ChainResult(list(draft_tokens) + [bonus], len(draft_tokens), "bonus")


ToyModel = Callable[[tuple[int, ...]], list[F]]  # prefix -> next-token distribution


def chain_round_outcomes(prefix: tuple[int, ...], target: ToyModel, draft: ToyModel | None, gamma: int,
                         greedy_draft: bool = False) -> dict[tuple[int, ...], F]:
    """Exact distribution of the tokens one chain round emits after ``prefix``.

    draft=None with greedy_draft=False is invalid; greedy_draft=True proposes the draft's argmax
    (lowest id on ties) as a point mass.
    """
    outcomes: dict[tuple[int, ...], F] = {}

    def walk(emitted: tuple[int, ...], mass: F, depth: int) -> None:
        context = prefix + emitted
        p = target(context)
        if depth == gamma:
            for token, pt in enumerate(p):
                if pt:
                    _add(outcomes, emitted + (token,), mass * pt)
            return
        q = draft(context)
        if greedy_draft:
            best = max(range(len(q)), key=lambda t: (q[t], -t))
            q = one_hot(best, len(q))
        for token, qt in enumerate(q):
            if not qt:
                continue
            accept = min(F(1), p[token] / qt)
            if accept:
                walk(emitted + (token,), mass * qt * accept, depth + 1)
            if accept < 1:
                for recovered, rt in enumerate(residual_exact(p, q)):
                    if rt:
                        _add(outcomes, emitted + (recovered,), mass * qt * (1 - accept) * rt)

    walk((), F(1), 0)
    return outcomes


def spec_sequence_distribution(target: ToyModel, draft: ToyModel, gamma: int, length: int,
                               prefix: tuple[int, ...] = (), greedy_draft: bool = False) -> dict[tuple[int, ...], F]:
    """Exact distribution of the first ``length`` tokens produced by repeated chain rounds."""
    return repeated_rounds_distribution(
        lambda context: chain_round_outcomes(context, target, draft, gamma, greedy_draft), length, prefix)


def repeated_rounds_distribution(round_outcomes: Callable[[tuple[int, ...]], dict[tuple[int, ...], F]],
                                 length: int, prefix: tuple[int, ...] = ()) -> dict[tuple[int, ...], F]:
    """Exact distribution of the first ``length`` tokens emitted by rounds run one after another from
    ``prefix``; ``round_outcomes(context)`` is one round's {emitted tokens: probability} after ``context``."""
    result: dict[tuple[int, ...], F] = {}

    def run(emitted: tuple[int, ...], mass: F) -> None:
        if len(emitted) >= length:
            _add(result, emitted[:length], mass)
            return
        for tokens, weight in round_outcomes(prefix + emitted).items():
            run(emitted + tokens, mass * weight)

    run((), F(1))
    return result


def target_sequence_distribution(target: ToyModel, length: int, prefix: tuple[int, ...] = ()) -> dict[tuple[int, ...], F]:
    """Exact distribution of ``length`` tokens sampled from the target alone."""
    result: dict[tuple[int, ...], F] = {(): F(1)}
    for _ in range(length):
        grown: dict[tuple[int, ...], F] = {}
        for seq, mass in result.items():
            for token, pt in enumerate(target(prefix + seq)):
                if pt:
                    _add(grown, seq + (token,), mass * pt)
        result = grown
    return result


def _add(table: dict, key, mass: F) -> None:
    table[key] = table.get(key, F(0)) + mass


def verify_tree_exact(parents: Sequence[int], tokens: Sequence[int], draft_probs: Sequence[Dist] | None,
                      target_probs: Sequence[Dist], mode: str, uniforms: Sequence[F], final_uniform: F):
    """The tree rule in Fractions; same inputs and result as ``verify.tree.verify_tree``."""
    from verispec.verify.tree import TreeResult

    children: list[list[int]] = [[] for _ in parents]
    for node, parent in enumerate(parents):
        if node:
            children[parent].append(node)
    node, path = 0, []
    while True:
        p = list(target_probs[node])
        if not children[node]:
            return TreeResult([tokens[n] for n in path] + [sample_exact(p, final_uniform)], path, "bonus")
        q = list(draft_probs[node]) if mode != "deterministic" else None
        chosen = None
        for child in children[node]:
            x, u = tokens[child], uniforms[child - 1]
            if mode == "deterministic":
                if u < p[x]:
                    chosen = child
                    break
                p = _normalise_exact([0 if t == x else m for t, m in enumerate(p)], p)
                continue
            if u < min(F(1), p[x] / q[x]):
                chosen = child
                break
            p = _normalise_exact([max(pi - qi, F(0)) for pi, qi in zip(p, q)], p)
            if mode == "without_replacement":
                q = _normalise_exact([0 if t == x else m for t, m in enumerate(q)], q)
        if chosen is None:
            return TreeResult([tokens[n] for n in path] + [sample_exact(p, final_uniform)], path, "recovered")
        path.append(chosen)
        node = chosen


def _normalise_exact(dist: list[F], fallback: list[F]) -> list[F]:
    total = sum(dist, F(0))
    return [F(m) / total for m in dist] if total else fallback


# --- exact tree rounds: drafting and verification enumerated together --------------------------------

def sibling_draws(q: Dist, count: int, mode: str) -> dict[tuple[int, ...], F]:
    """Every way a node's ``count`` children can be drafted from q, in draw order, with its probability.

    iid: independent draws (duplicates allowed); without_replacement: sequential draws, each from q with
    the earlier ones removed and renormalised (at most as many as tokens with mass); deterministic: the
    top ``count`` tokens of q (lowest id on ties), with probability 1.

        >>> q = [F(1, 2), F(1, 2), F(0)]
        >>> sibling_draws(q, 2, "iid")[(0, 0)], sibling_draws(q, 3, "without_replacement")
        (Fraction(1, 4), {(0, 1): Fraction(1, 2), (1, 0): Fraction(1, 2)})
    """
    if mode == "deterministic":
        ranked = sorted(range(len(q)), key=lambda t: (-q[t], t))
        return {tuple(ranked[:count]): F(1)}
    draws: dict[tuple[int, ...], F] = {(): F(1)}
    for _ in range(count):
        grown: dict[tuple[int, ...], F] = {}
        for drawn, mass in draws.items():
            remaining = [F(0) if mode == "without_replacement" and t in drawn else qt for t, qt in enumerate(q)]
            total = sum(remaining, F(0))
            if not total:  # without replacement, every token with mass is drawn already
                _add(grown, drawn, mass)
            for token, qt in enumerate(remaining):
                if qt:
                    _add(grown, drawn + (token,), mass * qt / total)
        draws = grown
    return draws


def sibling_outcomes(p: Dist, q: Dist | None, siblings: Sequence[int], mode: str) -> tuple[list[F], list[F]]:
    """The exact outcome of trying ``siblings`` (drafted from q, in draw order) against target p at one node.

    Returns (accepted, recovered): accepted[i] is the probability that sibling i is the one accepted;
    recovered[t] that every sibling is rejected and t is the recovered token. Together they sum to 1.
    Rules as in ``verify.tree``: accept x with min(1, p(x)/q(x)) (deterministic: p(x)); after rejecting x,
    iid: p <- norm(max(0, p - q)); without_replacement: the same with q_cur, then q_cur[x] = 0 and
    renormalise; deterministic: p[x] = 0 and renormalise.

        >>> p, q = [F(1, 2), F(1, 2)], [F(1), F(0)]
        >>> sibling_outcomes(p, q, [0, 0], "iid")   # the duplicate is tried again, against the residual
        ([Fraction(1, 2), Fraction(0, 1)], [Fraction(0, 1), Fraction(1, 2)])
    """
    p, q = list(p), (list(q) if q is not None else None)
    accepted, all_rejected = [], F(1)
    for x in siblings:
        accept = p[x] if mode == "deterministic" else min(F(1), p[x] / q[x])
        accepted.append(all_rejected * accept)
        all_rejected *= 1 - accept
        if mode == "deterministic":
            p = _normalise_exact([F(0) if t == x else m for t, m in enumerate(p)], p)
            continue
        p = _normalise_exact([max(pi - qi, F(0)) for pi, qi in zip(p, q)], p)
        if mode == "without_replacement":
            q = _normalise_exact([F(0) if t == x else m for t, m in enumerate(q)], q)
    return accepted, [all_rejected * m for m in p]


def tree_round_outcomes(prefix: tuple[int, ...], target: ToyModel, draft: ToyModel, branching: Sequence[int],
                        mode: str) -> dict[tuple[int, ...], F]:
    """Exact distribution of the tokens one tree round emits after ``prefix``.

    The tree is drafted level by level: a node at depth d (context c) gets ``branching[d]`` children drawn
    from draft(c) as in ``sibling_draws``; nodes at depth len(branching) are leaves. Verification walks
    from the root as ``verify_tree`` does: an accepted child is emitted and its subtree verified next; when
    every child is rejected a recovered token ends the round; an accepted leaf is followed by a bonus token
    from target(leaf context). Only the subtree of the accepted child is ever looked at, and each node's
    children are drawn independently of every other node's, so the walk drafts each subtree when it
    descends into it.

        >>> half = lambda prefix: [F(1, 2), F(1, 2)]
        >>> tree_round_outcomes((), half, half, [2], "iid")   # q == p: the first child is always accepted
        {(0, 0): Fraction(1, 4), (0, 1): Fraction(1, 4), (1, 0): Fraction(1, 4), (1, 1): Fraction(1, 4)}
    """
    outcomes: dict[tuple[int, ...], F] = {}

    def walk(emitted: tuple[int, ...], mass: F, depth: int) -> None:
        context = prefix + emitted
        p = target(context)
        if depth == len(branching):
            for bonus, pt in enumerate(p):
                if pt:
                    _add(outcomes, emitted + (bonus,), mass * pt)
            return
        q = draft(context)
        for siblings, draw_mass in sibling_draws(q, branching[depth], mode).items():
            accepted, recovered = sibling_outcomes(p, q, siblings, mode)
            for child, accept_mass in zip(siblings, accepted):
                if accept_mass:
                    walk(emitted + (child,), mass * draw_mass * accept_mass, depth + 1)
            for token, recover_mass in enumerate(recovered):
                if recover_mass:
                    _add(outcomes, emitted + (token,), mass * draw_mass * recover_mass)

    walk((), F(1), 0)
    return outcomes


def tree_spec_sequence_distribution(target: ToyModel, draft: ToyModel, branching: Sequence[int], mode: str,
                                    length: int, prefix: tuple[int, ...] = ()) -> dict[tuple[int, ...], F]:
    """Exact distribution of the first ``length`` tokens produced by repeated tree rounds."""
    return repeated_rounds_distribution(
        lambda context: tree_round_outcomes(context, target, draft, branching, mode), length, prefix)
