"""Generated token ids -> text, for whole responses and for streamed deltas.

Streaming must never send text it later has to take back, so the text that could still change is held:

- a trailing U+FFFD: a multi-byte character whose remaining bytes come in the next tokens;
- a trailing prefix of a stop string: "...Hel" with stop "Hello" may become a stop, which cuts the
  output before it (the engine reports where, as ``stop_text_index``).

    >>> text = StreamText(lambda ids: "".join(map(chr, ids)), stop_strings=("lo!",))
    >>> text.add([ord("H"), ord("e"), ord("l")])   # "l" may start "lo!": held
    'He'
    >>> text.finish([ord("l"), ord("o"), ord("!")], stop_text_index=3)   # "Hello!" cut before "lo!"
    'l'

Decoding the whole output each time keeps it simple and correct for tokenizers whose pieces depend
on their neighbours; the cost is quadratic in the output length, negligible at these lengths.
"""

from __future__ import annotations

from typing import Callable

REPLACEMENT = "\ufffd"


def final_text(text: str, stop_text_index: int | None) -> str:
    return text if stop_text_index is None else text[:stop_text_index]


class StreamText:
    def __init__(self, decode: Callable[[list[int]], str], stop_strings: tuple[str, ...] = ()):
        self.decode, self.stop_strings = decode, stop_strings
        self.tokens: list[int] = []
        self.sent = ""

    def add(self, tokens: list[int]) -> str:
        """The new text that is safe to send after ``tokens`` were generated ("" if none)."""
        self.tokens.extend(tokens)
        text = self.decode(self.tokens)
        safe = text[:len(text) - self._unstable_suffix(text)]
        return self._advance(safe)

    def finish(self, tokens: list[int], stop_text_index: int | None) -> str:
        """The rest of the text, given the request's last ``tokens`` (not passed to ``add``: their text
        may hold a stop string that ``stop_text_index`` cuts off)."""
        self.tokens.extend(tokens)
        return self._advance(final_text(self.decode(self.tokens), stop_text_index))

    def _advance(self, safe: str) -> str:
        if len(safe) <= len(self.sent) or not safe.startswith(self.sent):
            return ""  # nothing new (or a tokenizer that rewrote the past: never resend)
        delta, self.sent = safe[len(self.sent):], safe
        return delta

    def _unstable_suffix(self, text: str) -> int:
        held = len(text) - len(text.rstrip(REPLACEMENT))
        for stop in self.stop_strings:
            for length in range(min(len(stop) - 1, len(text)), 0, -1):
                if text.endswith(stop[:length]):
                    held = max(held, length)
                    break
        return held
