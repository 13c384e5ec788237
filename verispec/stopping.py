"""Stop rules shared by the single-sequence and batched engines.

    >>> cut = apply_stop_rules([5, 0, 7], generated=[1, 2], stop=StopRules(max_tokens=10, eos_ids=(0,)))
    >>> cut.kept, cut.finish_reason
    ([5, 0], 'stop')

Tokens after EOS are never committed; EOS itself is (as in HF generate) and is skipped when decoding.
A stop string is cut at the first token that completes it; ``stop_text_index`` says where it starts in
the decoded output so the text can end just before it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from verispec.config import StopRules

Decode = Callable[[list[int]], str]


@dataclass(frozen=True)
class StopCut:
    kept: list[int]
    finish_reason: str | None  # "stop", "length" or None (keep going)
    stop_text_index: int | None = None


def apply_stop_rules(tokens: list[int], generated: list[int], stop: StopRules,
                     decode: Decode | None = None) -> StopCut:
    """Which of ``tokens`` (emitted after ``generated``) to keep, and whether the request ends."""
    kept = tokens[:stop.max_tokens - len(generated)]
    reason, index = None, None
    if not stop.ignore_eos:
        for i, token in enumerate(kept):
            if token in stop.eos_ids:
                kept, reason = kept[:i + 1], "stop"
                break
    if stop.stop_strings and decode is not None:
        for count in range(1, len(kept) + 1):
            text = decode(generated + kept[:count])
            hits = [text.find(s) for s in stop.stop_strings if s in text]
            if hits:
                kept, reason, index = kept[:count], "stop", min(hits)
                break
    if reason is None and len(generated) + len(kept) >= stop.max_tokens:
        reason = "length"
    return StopCut(kept, reason, index)
