"""Two tokenizers compared by the bytes their tokens stand for, and the bridge a draft with its own
tokenizer drafts through (token-level intersection).

A token of the draft's vocabulary whose bytes are exactly one token of the target's is *shared*. The
bridge turns the draft's logits into logits over the target's ids (a shared token's logit at its target
id, -inf at every other id), so whatever the draft samples from is a distribution q over the target's
vocabulary that is zero outside the shared tokens: verification against the target's p stays exact for
any such q. The draft reads the committed text in its own tokens: the target's ids are turned back into
bytes and re-tokenized by the draft's tokenizer.

    bridge = VocabBridge.build(target_tokenizer, draft_tokenizer, target_vocab=49152, draft_vocab=8192)
    draft_ids = bridge.draft_context(committed_target_ids)
    target_logits = bridge.spread(draft_logits)      # (target_vocab,), -inf outside the intersection
    bridge.to_draft[target_id]                       # the draft's id of a shared token, -1 otherwise
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

import torch

from verispec.errors import CheckpointError

_HEX_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def byte_level_alphabet() -> dict[str, int]:
    """The character byte-level BPE writes for each byte: bytes that are printable Latin-1 characters
    stand for themselves; the other 68 take the characters from U+0100 on, in byte order."""
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAC + 1)) | set(range(0xAE, 0xFF + 1))
    alphabet, shifted = {}, 0
    for byte in range(256):
        if byte in printable:
            alphabet[chr(byte)] = byte
        else:
            alphabet[chr(256 + shifted)] = byte
            shifted += 1
    return alphabet


def decoder_kind(tokenizer) -> str:
    """How a tokenizer's vocabulary strings map to text: "byte_level" (GPT-2 style), "metaspace"
    (SentencePiece: U+2581 for a space, <0xNN> byte tokens) or "text" (the strings themselves)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return "text"
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    kinds = json.dumps(decoder)
    if '"ByteLevel"' in kinds:
        return "byte_level"
    if '"Metaspace"' in kinds or "\u2581" in kinds or '"ByteFallback"' in kinds:
        return "metaspace"
    return "text"


def token_bytes(tokenizer, vocab_size: int) -> list[bytes | None]:
    """The bytes each id below ``vocab_size`` stands for (None for an id the tokenizer lacks). Added
    and special tokens are their own text."""
    kind = decoder_kind(tokenizer)
    alphabet = byte_level_alphabet() if kind == "byte_level" else {}
    added = {index: str(token) for index, token in getattr(tokenizer, "added_tokens_decoder", {}).items()}
    result: list[bytes | None] = [None] * vocab_size
    for token, index in tokenizer.get_vocab().items():
        if index >= vocab_size:
            continue
        if index in added or token in added.values():
            result[index] = token.encode()
        elif kind == "byte_level" and all(char in alphabet for char in token):
            result[index] = bytes(alphabet[char] for char in token)
        elif kind == "metaspace":
            match = _HEX_BYTE.fullmatch(token)
            result[index] = bytes([int(match.group(1), 16)]) if match else token.replace("\u2581", " ").encode()
        else:
            result[index] = token.encode()
    return result


@dataclass
class VocabBridge:
    """Token-level intersection of a draft's vocabulary with the target's (see the module docstring)."""

    target_bytes: list[bytes]  # per target id; b"" for ids the target's tokenizer lacks
    to_draft: torch.Tensor  # (target_vocab,) int64: the draft's id of each shared token, -1 elsewhere
    draft_ids: torch.Tensor  # (S,) int64, ascending: the shared tokens' draft ids
    target_ids: torch.Tensor  # (S,) int64: the same tokens' target ids
    draft_tokenizer: object
    _cached: tuple[list[int], list[int]] = field(default=([], []), repr=False)

    @classmethod
    def build(cls, target_tokenizer, draft_tokenizer, target_vocab: int, draft_vocab: int) -> "VocabBridge":
        """The bridge between two tokenizers; a token with the same bytes under several ids keeps its
        lowest id on either side. Refuses tokenizers that share no token."""
        target_bytes = token_bytes(target_tokenizer, target_vocab)
        by_bytes: dict[bytes, int] = {}
        for index, data in enumerate(target_bytes):
            if data:
                by_bytes.setdefault(data, index)
        to_draft = torch.full((target_vocab,), -1, dtype=torch.long)
        pairs = []
        for draft_id, data in enumerate(token_bytes(draft_tokenizer, draft_vocab)):
            target_id = by_bytes.get(data) if data else None
            if target_id is not None and int(to_draft[target_id]) < 0:
                to_draft[target_id] = draft_id
                pairs.append((draft_id, target_id))
        if not pairs:
            raise CheckpointError("the draft's tokenizer shares no token with the target's, so it cannot draft for it")
        draft_ids, target_ids = torch.tensor(pairs, dtype=torch.long).T.contiguous()
        return cls([data or b"" for data in target_bytes], to_draft, draft_ids, target_ids, draft_tokenizer)

    @property
    def shared(self) -> int:
        """How many tokens the two vocabularies share."""
        return int(self.draft_ids.numel())

    def spread(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """Logits over the target's ids from the draft's (last dimension; a draft head scoring only its
        first N ids gives logits for those): shared tokens keep theirs, every other id gets -inf."""
        width = draft_logits.shape[-1]
        keep = self.draft_ids < width
        out = torch.full((*draft_logits.shape[:-1], self.to_draft.numel()), float("-inf"), dtype=torch.float32)
        out[..., self.target_ids[keep]] = draft_logits[..., self.draft_ids[keep]].float()
        return out

    def text(self, context: list[int]) -> str:
        """The committed text of target ids (bytes that do not form UTF-8 yet, e.g. half a character at
        the end, are left out)."""
        return b"".join(self.target_bytes[token] for token in context).decode("utf-8", errors="ignore")

    def draft_context(self, context: list[int]) -> list[int]:
        """The draft's tokens for the text of ``context`` (target ids), re-tokenized whole (the last
        call's answer is reused for the same context)."""
        if self._cached[0] == context:
            return list(self._cached[1])
        ids = list(self.draft_tokenizer.encode(self.text(context), add_special_tokens=False))
        self._cached = (list(context), ids)
        return list(ids)
