"""Exact reference implementations over fractions.Fraction: the oracle the float code is tested against.

Distributions are sequences of Fractions indexed by token id. Nothing here is fast; everything here is
obviously the rule in SEED.md / DESIGN.md, so the float paths are checked against it.

SEED.md's worked example:

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
    """The chain rule of DESIGN.md, one draft at a time."""
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
    result: dict[tuple[int, ...], F] = {}

    def run(emitted: tuple[int, ...], mass: F) -> None:
        if len(emitted) >= length:
            _add(result, emitted[:length], mass)
            return
        for tokens, weight in chain_round_outcomes(prefix + emitted, target, draft, gamma, greedy_draft).items():
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
