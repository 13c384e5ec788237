"""The gamma-policy protocol the engines use, what every policy is fed, and the simple policies.

``GammaPolicy`` is what an engine calls (``check_policy`` verifies it once); ``GammaPolicyBase`` gives its
defaults. ``AcceptanceCounts`` counts per-position acceptance and ``Backlog`` is what the draft must read
before a round. ``FixedGamma`` drafts the same gamma every round, ``HFHeuristicGamma`` is transformers'
assisted-generation rule (+2 after a round that accepted every draft, -1 otherwise) for comparison, and
``CycleGamma`` is the calibration's cycle 1..N. The policy that learns from measured costs is
``adaptive.AdaptiveGamma``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from verispec.errors import VerispecError


@dataclass(frozen=True)
class Backlog:
    """Before a round: what the draft must read before it can draft for every row (tokens committed
    since it last read each row, prompts included), and what the rows may still generate."""

    tokens: int
    remaining: int


class AcceptanceCounts:
    """Per draft position i (1-based): rounds that tested it (reached it: accepted i - 1 drafts and
    drafted at least i) and rounds that accepted it; and rounds that drafted, and of those the ones
    that accepted every draft (``full_share``)."""

    def __init__(self, max_position: int = 64):
        self.reached = [0] * (max_position + 1)
        self.accepted = [0] * (max_position + 1)
        self.rounds = self.full = 0

    def add(self, accepted: int, drafted: int) -> None:
        if drafted:
            self.rounds += 1
            self.full += accepted == drafted
        for position in range(1, min(drafted, accepted + 1, len(self.reached) - 1) + 1):
            self.reached[position] += 1
            if position <= accepted:
                self.accepted[position] += 1

    def full_share(self) -> float | None:
        """Share of drafting rounds that accepted every draft; None before any."""
        return self.full / self.rounds if self.rounds else None

    def rates(self, positions: int, prior: list[float] | None = None, prior_rounds: float = 0.0) -> list[float]:
        """Conditional acceptance at positions 1..``positions``: accepted / reached, pulled towards
        ``prior`` as if it had been seen ``prior_rounds`` times. Where nothing is known: the previous
        position's rate (0.5 at position 1), since a draft that was right so far tends to stay right."""
        out = []
        for i in range(1, positions + 1):
            unknown = out[-1] if out else 0.5
            base = prior[i - 1] if prior is not None and i - 1 < len(prior) else unknown
            reached = self.reached[i] if i < len(self.reached) else 0
            accepted = self.accepted[i] if i < len(self.accepted) else 0
            weight = prior_rounds if prior is not None else 0.0
            out.append((accepted + weight * base) / (reached + weight) if reached + weight else unknown)
        return out


class GammaPolicy(Protocol):
    """What the engines use of a draft-length policy, and nothing else (``check_policy`` verifies it
    once): ``choose`` the drafts for a round, ``observe`` its outcome; ``charge`` (seconds the draft spent
    reading new requests' prompts, a cost of speculating at all), ``reads`` (seconds per token the draft
    spends catching up), ``finished`` (a request's output length) and ``afford`` (whether the draft's
    catch-up before a round is worth it). ``GammaPolicyBase`` gives the defaults."""

    def choose(self, batch_size: int = 1, request: AcceptanceCounts | None = None) -> int: ...

    def observe(self, batch_size: int, gamma: int, seconds: float, accepted_per_row: list[int],
                drafted_per_row: list[int]) -> None: ...

    def charge(self, batch_size: int, seconds: float, prompts: int = 1) -> None: ...

    def reads(self, tokens: int, seconds: float) -> None: ...

    def finished(self, output_tokens: int) -> None: ...

    def afford(self, batch_size: int, gamma: int, backlog: Backlog) -> int: ...


class GammaPolicyBase:
    """Defaults for the ``GammaPolicy`` protocol: learns nothing from outcomes, charges, reads or finished
    requests, and affords whatever it chose."""

    def observe(self, batch_size: int, gamma: int, seconds: float, accepted_per_row: list[int],
                drafted_per_row: list[int]) -> None:
        """A policy that does not learn ignores outcomes."""

    def charge(self, batch_size: int, seconds: float, prompts: int = 1) -> None:
        """Prompt reads are no concern of a policy that does not weigh costs."""

    def reads(self, tokens: int, seconds: float) -> None:
        """Nor is the draft's price per token read."""

    def finished(self, output_tokens: int) -> None:
        """Nor are output lengths."""

    def afford(self, batch_size: int, gamma: int, backlog: Backlog) -> int:
        return gamma


POLICY_MEMBERS = ("choose", "observe", "charge", "reads", "finished", "afford")


def check_policy(policy) -> None:
    """Raise ``VerispecError`` naming what a gamma policy lacks of the ``GammaPolicy`` protocol."""
    missing = [name for name in POLICY_MEMBERS if not callable(getattr(policy, name, None))]
    if missing:
        raise VerispecError(f"{type(policy).__name__} does not implement the GammaPolicy protocol: missing "
                            f"{', '.join(missing)} (subclass verispec.adaptive.GammaPolicyBase for the defaults)")


def report_draft_reads(policy: GammaPolicy, batch_size: int, charged_s: float, tokens: int, seconds: float,
                       prompts: int = 1) -> None:
    """Tell ``policy`` what the draft read before a round: ``tokens`` in ``seconds`` in all (its price
    per token), of which ``charged_s`` were ``prompts`` new requests' prompts."""
    if charged_s and prompts:
        policy.charge(batch_size, charged_s, prompts)
    if tokens:
        policy.reads(tokens, seconds)


class FixedGamma(GammaPolicyBase):
    """The same gamma every round."""

    def __init__(self, gamma: int):
        self.gamma = gamma

    def choose(self, batch_size: int = 1, request: AcceptanceCounts | None = None) -> int:
        return self.gamma


class CycleGamma(GammaPolicyBase):
    """Calibration, not serving: rounds draft 1, 2, ..., ``top``, 1, ... in turn, so that every width's
    round is timed in one decoding loop, interleaved, under the same machine conditions."""

    def __init__(self, top: int):
        self.top, self.last = top, 0

    def choose(self, batch_size: int = 1, request: AcceptanceCounts | None = None) -> int:
        self.last = self.last % self.top + 1
        return self.last


class HFHeuristicGamma(GammaPolicyBase):
    """transformers' schedule: start at ``initial``; +2 when every draft was accepted, else -1 (min 1)."""

    def __init__(self, initial: int = 4, max_gamma: int = 16):
        self.gamma, self.max_gamma = initial, max_gamma

    def choose(self, batch_size: int = 1, request: AcceptanceCounts | None = None) -> int:
        return self.gamma

    def observe(self, batch_size: int, gamma: int, seconds: float, accepted_per_row: list[int],
                drafted_per_row: list[int]) -> None:
        if all(a == d for a, d in zip(accepted_per_row, drafted_per_row)):
            self.gamma = min(self.max_gamma, self.gamma + 2)
        else:
            self.gamma = max(1, self.gamma - 1)
