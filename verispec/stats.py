"""Per-round and per-request records. Every metric is defined once, here, next to its formula.

Definitions (also in docs/algorithms.md, "Metrics"):

- round: one verification pass of the target.
- committed tokens per round = accepted drafts + 1 (recovered or bonus), minus tokens cut by EOS,
  stop strings or max_tokens. Its mean equals vLLM's "mean acceptance length".
- draft acceptance rate = accepted draft tokens / proposed draft tokens. For trees a round "proposes"
  as many positions as the tree is deep (the most it could accept); the verified tree nodes are
  reported separately as ``tree_nodes`` and are never called accepted tokens.
- per-position acceptance, for draft position i (1-based):
  unconditional = rounds that accepted position i / rounds that proposed at least i drafts;
  conditional = rounds that accepted position i / rounds that reached position i (accepted i - 1).
- acceptance histogram: number of rounds with 0, 1, ..., K accepted drafts.
- TTFT: request start -> first token available (prefill + first sample).
- inter-token latency: each emitted token gets the gap since the previous emitted token; a round that
  emits n tokens at once contributes one real gap and n - 1 gaps of 0. chunk gaps: the gaps between
  emitted chunks (the visible bursts).
- tokens_per_s = generated tokens / end-to-end seconds (prefill included);
  decode_tokens_per_s = (generated - 1) / (end-to-end - TTFT).
- time split per round: drafting, verification (target forward + rejection sampling), state handling
  (cache rollback / compaction / refresh), other (stop rules, bookkeeping).
"""

from __future__ import annotations

import math
import random

from dataclasses import asdict, dataclass, field
from typing import Literal

ACCEPTANCE_RATE_DEFINITION = "accepted draft tokens / proposed draft tokens"


@dataclass
class RoundRecord:
    drafted: int
    accepted: int
    committed: int  # after EOS / stop / max_tokens cuts
    last_kind: Literal["recovered", "bonus", "cut"]
    draft_s: float = 0.0
    draft_read_s: float = 0.0  # part of draft_s: the draft reading a prompt or backlog before drafting
    verify_s: float = 0.0
    state_s: float = 0.0  # committing: target state refresh + drafter rollback + stop rules
    refresh_s: float = 0.0  # the target-state refresh alone (part of state_s)
    other_s: float = 0.0
    tree_nodes: int = 0  # verified nodes (trees); equals drafted for chains

    @property
    def total_s(self) -> float:
        return self.draft_s + self.verify_s + self.state_s + self.other_s


@dataclass
class RequestStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    rounds: list[RoundRecord] = field(default_factory=list)
    prefill_s: float = 0.0
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    token_gaps_s: list[float] = field(default_factory=list)
    chunk_gaps_s: list[float] = field(default_factory=list)
    finish_reason: str = ""

    # ---- counts --------------------------------------------------------------------------------
    @property
    def drafted(self) -> int:
        return sum(r.drafted for r in self.rounds)

    @property
    def accepted(self) -> int:
        return sum(r.accepted for r in self.rounds)

    @property
    def committed_per_round(self) -> float:
        """Mean committed tokens per verification round."""
        return sum(r.committed for r in self.rounds) / len(self.rounds) if self.rounds else 0.0

    @property
    def acceptance_rate(self) -> float:
        """accepted draft tokens / proposed draft tokens."""
        return self.accepted / self.drafted if self.drafted else 0.0

    def per_position_acceptance(self) -> dict[str, list[float]]:
        """Unconditional and conditional acceptance per draft position (see module docstring)."""
        depth = max((r.drafted for r in self.rounds), default=0)
        unconditional, conditional = [], []
        for i in range(1, depth + 1):
            proposed = sum(1 for r in self.rounds if r.drafted >= i)
            reached = sum(1 for r in self.rounds if r.drafted >= i and r.accepted >= i - 1)
            accepted = sum(1 for r in self.rounds if r.accepted >= i)
            unconditional.append(accepted / proposed if proposed else 0.0)
            conditional.append(accepted / reached if reached else 0.0)
        return {"unconditional": unconditional, "conditional": conditional}

    def acceptance_histogram(self) -> list[int]:
        depth = max((r.drafted for r in self.rounds), default=0)
        histogram = [0] * (depth + 1)
        for r in self.rounds:
            histogram[r.accepted] += 1
        return histogram

    # ---- time --------------------------------------------------------------------------------------
    def time_split(self) -> dict[str, float]:
        return {
            "prefill_ms": 1e3 * self.prefill_s,
            "draft_ms": 1e3 * sum(r.draft_s for r in self.rounds),
            "verify_ms": 1e3 * sum(r.verify_s for r in self.rounds),
            "state_ms": 1e3 * sum(r.state_s for r in self.rounds),
            "refresh_ms": 1e3 * sum(r.refresh_s for r in self.rounds),
            "other_ms": 1e3 * sum(r.other_s for r in self.rounds),
        }

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.e2e_s if self.e2e_s > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        decode_s = self.e2e_s - self.ttft_s
        return (self.generated_tokens - 1) / decode_s if decode_s > 0 else 0.0

    def summary(self) -> dict:
        """The per-request summary printed by ``generate --json`` and recorded by benchmarks."""
        tree_nodes = [r.tree_nodes for r in self.rounds]
        return {
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.generated_tokens,
            "finish_reason": self.finish_reason,
            "rounds": len(self.rounds),
            "drafted": self.drafted,
            "accepted": self.accepted,
            "committed_per_round": self.committed_per_round,
            "acceptance_rate": self.acceptance_rate,
            "acceptance_rate_definition": ACCEPTANCE_RATE_DEFINITION,
            "per_position_acceptance": self.per_position_acceptance(),
            "acceptance_histogram": self.acceptance_histogram(),
            "tree_nodes": sum(tree_nodes) / len(tree_nodes) if tree_nodes else 0.0,
            "ttft_ms": 1e3 * self.ttft_s,
            "e2e_ms": 1e3 * self.e2e_s,
            "tokens_per_s": self.tokens_per_s,
            "decode_tokens_per_s": self.decode_tokens_per_s,
            "time_split": self.time_split(),
            "median_itl_ms": 1e3 * percentile(self.token_gaps_s, 50),
            "p95_itl_ms": 1e3 * percentile(self.token_gaps_s, 95),
            "median_chunk_gap_ms": 1e3 * percentile(self.chunk_gaps_s, 50),
            "p95_chunk_gap_ms": 1e3 * percentile(self.chunk_gaps_s, 95),
        }

    def rounds_as_dicts(self) -> list[dict]:
        return [asdict(r) for r in self.rounds]


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), 0.0 for an empty list."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def median_interval(values: list[float], level: float = 0.95) -> tuple[float, float, float] | None:
    """Distribution-free confidence interval for the median: the order statistics (k-th smallest,
    k-th largest) with the largest k whose coverage, 1 - 2 P(Binomial(n, 1/2) < k), is at least ``level``.
    Returns (low, high, coverage), or None when even (min, max) covers less than ``level`` (n < 6 at 95%)."""
    n = len(values)
    ordered = sorted(values)
    best = None
    below = 0.0  # P(Binomial(n, 1/2) <= k - 1)
    for k in range(1, n // 2 + 1):
        below += math.comb(n, k - 1) / 2 ** n
        coverage = 1 - 2 * below
        if coverage < level:
            break
        best = (ordered[k - 1], ordered[n - k], coverage)
    return best


def ratio_interval(numerators: list[float], denominators: list[float], level: float = 0.95,
                   resamples: int = 2000, seed: int = 0) -> tuple[float, float] | None:
    """Percentile-bootstrap interval for sum(numerators) / sum(denominators), resampling the pairs
    (one pair per prompt: its accepted and proposed drafts, say), so a prompt's tokens stay together.
    Deterministic for a given ``seed``; None with fewer than two pairs."""
    pairs = list(zip(numerators, denominators, strict=True))
    if len(pairs) < 2:
        return None
    rng = random.Random(seed)
    n, ratios = len(pairs), []
    for _ in range(resamples):
        top = bottom = 0.0
        for _ in range(n):
            a, b = pairs[rng.randrange(n)]
            top, bottom = top + a, bottom + b
        ratios.append(top / bottom if bottom else 0.0)
    tail = (1 - level) / 2 * 100
    return percentile(ratios, tail), percentile(ratios, 100 - tail)
