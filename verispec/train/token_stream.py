"""Training token stream: workloads mixed by token share, cut into shuffled fixed-length windows.

    stream = MixedTokenStream(encode_batch, eos_id=0, mix={"code": 0.5, "chat": 0.35, "math": 0.15})
    tokens = stream.take(1_000_000)   # ~500k code, ~350k chat, ~150k math tokens, EOS between documents
    batches = WindowBatches(stream, seq_len=256, batch_size=16, seed=0)
    next(batches).shape               # (16, 257) = (B, T + 1): inputs [:, :-1], next-token labels [:, 1:]

The mix is kept by always taking the next document from the workload furthest below its share, so any
prefix of the stream is mixed, not just the whole.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Mapping

import numpy as np
import torch

from verispec.train.corpus import ChatRenderer, Split, Workload, iter_documents_forever

DEFAULT_MIX: Mapping[Workload, float] = {"code": 0.50, "chat": 0.35, "math": 0.15}
EncodeBatch = Callable[[list[str]], list[list[int]]]


class MixedTokenStream:
    """An endless stream of token ids over the ``split`` documents of the workloads in ``mix``."""

    def __init__(self, encode_batch: EncodeBatch, eos_id: int, mix: Mapping[Workload, float] = DEFAULT_MIX,
                 split: Split = "train", seed: int = 0, encode_chunk: int = 32,
                 render_chat: ChatRenderer | None = None):
        if not mix or any(share <= 0 for share in mix.values()):
            raise ValueError(f"mix shares must be positive, got {dict(mix)}")
        total_share = sum(mix.values())
        self.shares = {name: share / total_share for name, share in mix.items()}
        self.tokens_taken = {name: 0 for name in mix}
        self.epochs_started = {name: 0 for name in mix}
        self._encode_batch, self._eos_id, self._encode_chunk = encode_batch, eos_id, encode_chunk
        self._documents = {name: iter_documents_forever(name, split, seed, render_chat) for name in mix}
        self._encoded: dict[str, list[list[int]]] = {name: [] for name in mix}
        self._pending: list[int] = []

    def _next_document_tokens(self, name: str) -> list[int]:
        if not self._encoded[name]:
            chunk = [next(self._documents[name]) for _ in range(self._encode_chunk)]
            self.epochs_started[name] = max(self.epochs_started[name], 1 + max(epoch for epoch, _ in chunk))
            self._encoded[name] = self._encode_batch([text for _, text in chunk])[::-1]
        return self._encoded[name].pop() + [self._eos_id]

    def take(self, num_tokens: int) -> np.ndarray:
        """The next ``num_tokens`` ids of the stream as int64."""
        while len(self._pending) < num_tokens:
            name = min(self.shares, key=lambda w: self.tokens_taken[w] / self.shares[w])
            tokens = self._next_document_tokens(name)
            self.tokens_taken[name] += len(tokens)
            self._pending.extend(tokens)
        taken, self._pending = self._pending[:num_tokens], self._pending[num_tokens:]
        return np.asarray(taken, dtype=np.int64)

    def stats(self) -> dict:
        """Tokens drawn per workload and how many passes over each workload have begun."""
        return {"tokens_taken": dict(self.tokens_taken), "epochs_started": dict(self.epochs_started)}


class WindowBatches(Iterator[torch.Tensor]):
    """Batches of ``seq_len + 1`` token windows drawn at random from a rolling buffer of the stream.

    Consecutive windows of one long document would land in the same batch without the buffer.
    """

    def __init__(self, stream: MixedTokenStream, seq_len: int, batch_size: int, seed: int,
                 buffer_windows: int = 1024):
        self.stream, self.seq_len, self.batch_size = stream, seq_len, batch_size
        self._rng = random.Random(seed)
        self._buffer: list[np.ndarray] = []
        self._buffer_windows = max(buffer_windows, batch_size)

    def prime(self) -> None:
        """Load and tokenize the first buffer now (slow: reads every workload), e.g. before a timer starts."""
        self._refill()

    def _refill(self) -> None:
        missing = self._buffer_windows - len(self._buffer)
        tokens = self.stream.take(missing * (self.seq_len + 1))
        self._buffer.extend(tokens.reshape(missing, self.seq_len + 1))

    def __next__(self) -> torch.Tensor:
        if len(self._buffer) < self._buffer_windows // 2 + self.batch_size:
            self._refill()
        rows = []
        for _ in range(self.batch_size):
            index = self._rng.randrange(len(self._buffer))
            self._buffer[index], self._buffer[-1] = self._buffer[-1], self._buffer[index]
            rows.append(self._buffer.pop())
        return torch.from_numpy(np.stack(rows))  # (B, T + 1)
