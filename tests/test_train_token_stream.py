"""The training token stream: mixed by token share at every prefix, EOS after each document, and
shuffled (T + 1)-token windows. Fake workloads stand in for the corpus."""

from __future__ import annotations

import itertools

import pytest
import torch

from verispec.train import token_stream
from verispec.train.token_stream import MixedTokenStream, WindowBatches

DOCUMENT_LENGTH, FIRST_ID = {"code": 9, "chat": 4}, {"code": 100, "chat": 200}


@pytest.fixture
def fake_workloads(monkeypatch):
    """Workloads whose documents are "<workload> <index>"; records how each was opened."""
    opened = []

    def documents(name, split, seed, render_chat=None):
        opened.append((name, split, seed, render_chat))
        return ((index // 5, f"{name} {index}") for index in itertools.count())  # (epoch, document)

    monkeypatch.setattr(token_stream, "iter_documents_forever", documents)
    return opened


def encode(texts):
    """Document "code 3" is id 103 nine times; "chat 3" is 203 four times."""
    documents = [text.split() for text in texts]
    return [[FIRST_ID[name] + int(index)] * DOCUMENT_LENGTH[name] for name, index in documents]


def test_stream_keeps_the_mix_at_every_prefix_and_ends_documents_with_eos(fake_workloads):
    stream = MixedTokenStream(encode, eos_id=0, mix={"code": 2, "chat": 1}, split="heldout", seed=5)
    assert sorted(fake_workloads) == [("chat", "heldout", 5, None), ("code", "heldout", 5, None)]
    # Next document from the workload furthest below its share (ties: the first in the mix).
    expected = [100] * 9 + [0] + [200] * 4 + [0] + [101] * 9 + [0] + [201] * 4 + [0]
    assert stream.take(7).tolist() + stream.take(23).tolist() == expected
    stream.take(300)
    taken = stream.stats()["tokens_taken"]
    assert abs(taken["code"] - 2 * taken["chat"]) <= 10  # within one document of 2:1
    assert stream.stats()["epochs_started"] == {"code": 7, "chat": 7}  # 32-document chunks, 5 per epoch
    with pytest.raises(ValueError, match="mix shares must be positive"):
        MixedTokenStream(encode, 0, {"code": 1, "chat": 0})


def test_window_batches_draw_each_window_once_in_a_seeded_order(fake_workloads):
    def batches(seed):
        stream = MixedTokenStream(encode, 0, {"code": 1, "chat": 1})
        return WindowBatches(stream, seq_len=4, batch_size=2, seed=seed, buffer_windows=4)

    windows = MixedTokenStream(encode, 0, {"code": 1, "chat": 1}).take(6 * 5).reshape(6, 5).tolist()
    drawn = batches(0)
    first, second = next(drawn), next(drawn)
    assert first.shape == (2, 5) and first.dtype == torch.int64  # (B, T + 1)
    assert all(row in windows[:4] for row in first.tolist())  # from the first buffer of 4 windows
    rows = first.tolist() + second.tolist()
    assert all(row in windows for row in rows) and len({tuple(row) for row in rows}) == 4
    again = batches(0)
    assert torch.equal(next(again), first) and torch.equal(next(again), second)
