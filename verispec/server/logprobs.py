"""The engine's per-token logprobs -> OpenAI's ``logprobs`` objects, for a whole response or chunk by chunk.

For the tokens "Hi", "!" asking for one alternative each, completions (OpenAI's legacy format) get

    {"tokens": ["Hi", "!"], "token_logprobs": [-0.4, -1.2], "top_logprobs": [{"Hi": -0.4}, {"?": -0.9}],
     "text_offset": [0, 2]}

(``top_logprobs`` is None when no alternatives were asked for) and chat gets

    {"content": [{"token": "Hi", "logprob": -0.4, "bytes": [72, 105],
                  "top_logprobs": [{"token": "Hi", "logprob": -0.4, "bytes": [72, 105]}]}, ...]}

Which tokens are reported follows the text. A token whose text starts where a stop string cuts the
output, or after, is not reported. A stream reports a token in the chunk that sends the last of its
text (a token with no text of its own, such as a piece of a character, once text after it is sent),
so the chunks' lists concatenate to the non-streamed list. ``text_offset`` counts characters from the
start of the completion.

A token's string is its decoded text; a token that holds only part of a character's bytes (byte-level
BPE, SentencePiece byte fallback) reads ``"bytes:\\xe2\\x80"``, and ``bytes`` are its real bytes.
"""

from __future__ import annotations

import functools
import re
from typing import Callable

from verispec.batch import TokenLogprob
from verispec.server.text import REPLACEMENT

TOKEN_STRINGS_CACHED = 1 << 16
BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's piece for a raw byte


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, symbol -> byte: printable bytes stand for themselves, the others
    for the 256 code points from U+0100 on, in order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [byte for byte in range(256) if byte not in printable]
    return {chr(byte): byte for byte in printable} | {chr(256 + i): byte for i, byte in enumerate(others)}


BYTE_LEVEL = _byte_level_alphabet()


class TokenStrings:
    """Token id -> (string, UTF-8 bytes) as OpenAI shows them; cached."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.lookup = functools.lru_cache(maxsize=TOKEN_STRINGS_CACHED)(self._lookup)

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        return self.lookup(token_id)

    def _lookup(self, token_id: int) -> tuple[str, list[int]]:
        text = self.tokenizer.decode([token_id], skip_special_tokens=False)
        if REPLACEMENT not in text:
            return text, list(text.encode())
        raw = _piece_bytes(self.tokenizer.convert_ids_to_tokens(token_id)) or text.encode()
        try:
            return raw.decode(), list(raw)
        except UnicodeDecodeError:  # part of a character
            return "bytes:" + "".join(f"\\x{byte:02x}" for byte in raw), list(raw)


def _piece_bytes(piece: str | None) -> bytes | None:
    if not piece:
        return None
    fallback = BYTE_FALLBACK.fullmatch(piece)
    if fallback:
        return bytes([int(fallback.group(1), 16)])
    if all(symbol in BYTE_LEVEL for symbol in piece):
        return bytes(BYTE_LEVEL[symbol] for symbol in piece)
    return None


class LogprobReport:
    """One request's logprobs, reported as its text is: ``whole`` for a response, ``through`` then
    ``rest`` for a stream. ``top_n``: the alternatives asked for per token."""

    def __init__(self, decode: Callable[[list[int]], str], strings: TokenStrings, chat: bool, top_n: int):
        self.decode, self.strings, self.chat, self.top_n = decode, strings, chat, top_n
        self.tokens: list[int] = []
        self.entries: list[TokenLogprob] = []
        self.ends: list[int] = []  # where each token's text ends in the output
        self.reported = 0  # tokens reported so far

    def whole(self, tokens: list[int], entries: list[TokenLogprob], stop_text_index: int | None) -> dict:
        return self.rest(tokens, entries, stop_text_index) or self._format(0, 0)

    def through(self, tokens: list[int], entries: list[TokenLogprob], sent: int) -> dict | None:
        """After ``tokens`` came and the stream has sent ``sent`` characters: the tokens not reported yet
        whose text is all sent, and that precede sent text (None if none)."""
        self._add(tokens, entries)
        count = self.reported
        while count < len(self.tokens) and self._start(count) < sent and self.ends[count] <= sent:
            count += 1
        return self._take(count)

    def rest(self, tokens: list[int], entries: list[TokenLogprob], stop_text_index: int | None) -> dict | None:
        """After the last ``tokens``: every token not reported yet that starts before the stop cut."""
        self._add(tokens, entries)
        count = self.reported
        while count < len(self.tokens) and (stop_text_index is None or self._start(count) < stop_text_index):
            count += 1
        return self._take(count)

    def _add(self, tokens: list[int], entries: list[TokenLogprob] | None) -> None:
        # Decoding each prefix is quadratic in the output's length, as StreamText, and only paid on request.
        # A trailing U+FFFD is a character whose bytes are still coming: it starts, not ends, there.
        entries = entries or []
        assert len(entries) == len(tokens), "the engine sends one logprob per token of a request that asked"
        for token in tokens:
            self.tokens.append(token)
            self.ends.append(len(self.decode(self.tokens).rstrip(REPLACEMENT)))
        self.entries.extend(entries)

    def _start(self, index: int) -> int:
        return self.ends[index - 1] if index else 0

    def _take(self, count: int) -> dict | None:
        if count == self.reported:
            return None
        block, self.reported = self._format(self.reported, count), count
        return block

    def _format(self, begin: int, end: int) -> dict:
        tokens, entries = self.tokens[begin:end], self.entries[begin:end]
        if self.chat:
            return {"content": [self._chat_entry(token, entry) for token, entry in zip(tokens, entries)]}
        return {"tokens": [self.strings(token)[0] for token in tokens],
                "token_logprobs": [entry.logprob for entry in entries],
                "top_logprobs": [self._top_dict(entry) for entry in entries] if self.top_n else None,
                "text_offset": [self._start(index) for index in range(begin, end)]}

    def _top_dict(self, entry: TokenLogprob) -> dict[str, float]:
        top: dict[str, float] = {}
        for token, logprob in zip(entry.top_ids, entry.top_logprobs):
            top.setdefault(self.strings(token)[0], logprob)  # two tokens, one string: the likelier one
        return top

    def _chat_entry(self, token: int, entry: TokenLogprob) -> dict:
        return {**self._chat_token(token, entry.logprob),
                "top_logprobs": [self._chat_token(t, lp) for t, lp in zip(entry.top_ids, entry.top_logprobs)]}

    def _chat_token(self, token: int, logprob: float) -> dict:
        string, raw = self.strings(token)
        return {"token": string, "logprob": logprob, "bytes": raw}
