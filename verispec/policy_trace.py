"""A gamma policy's decisions, one JSON line per round, for finding out why a server speculated.

    policy = PolicyTrace(AdaptiveGamma(max_gamma=4), "runs/rounds.jsonl")
    engine = BatchEngine(target, draft, spec, gamma_policy=policy)

Each line: ``t`` (seconds since the trace opened), ``batch`` (rows in the round), ``load`` (the batch
size the policy chose for, where it has one), ``chosen`` (its gamma), ``backlog`` / ``remaining``
(tokens the draft had to read first / the rows may still generate, when it was asked whether the switch
pays; an adaptive policy adds its price per read token ``read_price`` and the gain it offers a first
climb in that bucket, ``gain``), ``gamma`` (what the round ran with after that), ``seconds`` (the round's steady time as the
policy saw it, without the draft's reads), ``drafted`` (rows that drafted), ``accepted`` (drafts accepted,
summed over rows), and where the draft read before the round ``read_tokens`` / ``read_s`` (all it read)
and ``charged_s`` / ``prompts`` (the part that was new requests' prompts, and how many).
Everything else is passed through to the wrapped policy. ``verispec serve --trace-rounds FILE`` wraps
the server's policy; lines are appended, each server start writes a ``{"start": ...}`` line first.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from verispec.adaptive import Backlog, GammaPolicy, check_policy


class PolicyTrace:
    def __init__(self, policy: GammaPolicy, path: str | Path):
        check_policy(policy)
        self.policy = policy
        self.file = open(path, "a", buffering=1)  # line-buffered: a killed server keeps its lines
        self.began = time.perf_counter()
        self.file.write(json.dumps({"start": time.time(), "policy": type(policy).__name__}) + "\n")
        self.pending: dict = {}

    def __getattr__(self, name):
        return getattr(self.policy, name)

    def choose(self, batch_size: int = 1, request=None) -> int:
        gamma = self.policy.choose(batch_size, request)
        load = getattr(self.policy, "load", None)
        self.pending = {"t": round(time.perf_counter() - self.began, 4), "batch": batch_size,
                        "load": load(batch_size) if load is not None else batch_size, "chosen": gamma}
        return gamma

    def afford(self, batch_size: int, gamma: int, backlog: Backlog) -> int:
        self.pending.update(backlog=backlog.tokens, remaining=backlog.remaining)
        read_price = getattr(self.policy, "read_seconds_per_token", lambda: None)()
        if read_price is not None:  # the adaptive policy's view of the switch
            gain = self.policy.first_climb_gain(batch_size)
            self.pending.update(read_price=round(read_price, 8), gain=None if gain is None else round(gain, 4))
        return self.policy.afford(batch_size, gamma, backlog)

    def reads(self, tokens: int, seconds: float) -> None:
        self.pending.update(read_tokens=tokens, read_s=round(seconds, 6))
        self.policy.reads(tokens, seconds)

    def charge(self, batch_size: int, seconds: float, prompts: int = 1) -> None:
        self.pending.update(charged_s=round(seconds, 6), prompts=prompts)
        self.policy.charge(batch_size, seconds, prompts)

    def observe(self, batch_size: int, gamma: int, seconds: float, accepted_per_row: list[int],
                drafted_per_row: list[int]) -> None:
        self.policy.observe(batch_size, gamma, seconds, accepted_per_row, drafted_per_row)
        line = {**self.pending, "gamma": gamma, "seconds": round(seconds, 6),
                "drafted": sum(1 for d in drafted_per_row if d), "accepted": sum(accepted_per_row)}
        self.file.write(json.dumps(line) + "\n")
        self.pending = {}

    def close(self) -> None:
        self.file.close()
