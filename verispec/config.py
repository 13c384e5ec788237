"""Frozen configuration objects; every default is defined here, once.

``SamplingParams`` is applied identically to target and draft of one request (see sampling.py).
``SpecConfig`` says how to speculate: method, gamma (drafts per round) and, for trees, the shape.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from verispec.errors import SamplingError

Method = Literal["none", "chain"]
METHODS: tuple[str, ...] = ("none", "chain")


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy; top_k 0, top_p 1 and min_p 0 switch their filter off."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    def __post_init__(self):
        if not self.temperature >= 0:
            raise SamplingError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not (isinstance(self.top_k, int) and self.top_k >= 0):
            raise SamplingError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise SamplingError(f"top_p must be in (0, 1] (1 = off), got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise SamplingError(f"min_p must be in [0, 1] (0 = off), got {self.min_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class StopRules:
    """When a request ends: max_tokens new tokens, an EOS id (unless ignore_eos) or a stop string."""

    max_tokens: int = 64
    eos_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    stop_strings: tuple[str, ...] = ()

    def __post_init__(self):
        if self.max_tokens < 1:
            raise SamplingError(f"max_tokens must be >= 1, got {self.max_tokens}")


@dataclass(frozen=True)
class SpecConfig:
    method: Method = "chain"
    gamma: int = 4
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self):
        if self.method not in METHODS:
            raise SamplingError(f"unknown method {self.method!r}; choose one of {', '.join(METHODS)}")
        if self.method != "none" and not 1 <= self.gamma <= 64:
            raise SamplingError(f"gamma must be in 1..64, got {self.gamma}")

    @property
    def enabled(self) -> bool:
        return self.method != "none"
