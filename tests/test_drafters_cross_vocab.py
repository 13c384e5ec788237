"""verispec.drafters.cross_vocab: a draft model drafting through a ``VocabBridge``, here over a tokenizer
whose ids are the reverse of the target's, so every draft must be the plain drafter's, mapped back (the
losslessness tests with real tokenizers are in test_vocab.py and test_engine_statistical.py)."""

from __future__ import annotations

import pytest
import torch

from conftest import VOCAB
from verispec.config import SamplingParams, TreeShape
from verispec.drafters.cross_vocab import CrossVocabDrafter
from verispec.drafters.draft_model import DraftModelDrafter
from verispec.errors import VerispecError
from verispec.models.llama import load_checkpoint
from verispec.vocab import VocabBridge

CHARS = [chr(0x30 + i) for i in range(VOCAB)]
GREEDY = SamplingParams(temperature=0.0)


class Pieces:
    """A tokenizer of one character per token."""

    def __init__(self, pieces):
        self.pieces = pieces

    def get_vocab(self):
        return {piece: index for index, piece in enumerate(self.pieces)}

    def encode(self, text, add_special_tokens=False):
        return [self.pieces.index(char) for char in text]


@pytest.fixture(scope="module")
def draft(checkpoints):
    return load_checkpoint(checkpoints["draft"], kernels=False)


def reversed_bridge() -> VocabBridge:
    """Target id t is the draft's id VOCAB - 1 - t."""
    return VocabBridge.build(Pieces(CHARS[::-1]), Pieces(CHARS), target_vocab=VOCAB, draft_vocab=VOCAB)


def flip(ids) -> list[int]:
    return [VOCAB - 1 - int(t) for t in ids]


def test_greedy_drafts_are_the_plain_drafters_in_target_ids(draft):
    cross, plain = CrossVocabDrafter(draft, reversed_bridge()), DraftModelDrafter(draft)
    for context in ([3, 9, 27], [3, 9, 27, 40, 2], [11]):  # the last one: a new request's
        plain.commit(flip(context))
        cross.commit(context)
        proposal = cross.propose(context, 4, GREEDY, torch.Generator())
        expected = plain.propose(flip(context), 4, GREEDY, torch.Generator())
        assert proposal.tokens.tolist() == flip(expected.tokens) and proposal.probs is None


def test_sampled_draft_rows_are_the_plain_drafters_over_target_ids(draft):
    sampling = SamplingParams(temperature=1.0)
    cross = CrossVocabDrafter(draft, reversed_bridge()).propose([5, 6, 7], 1, sampling, torch.Generator())
    plain = DraftModelDrafter(draft).propose(flip([5, 6, 7]), 1, sampling, torch.Generator())
    assert cross.probs.shape == (1, VOCAB)
    assert torch.allclose(cross.probs[0], plain.probs[0].flip(0), atol=1e-6)


def test_dynamic_trees_are_refused_and_a_full_draft_drafts_nothing(draft):
    cross = CrossVocabDrafter(draft, reversed_bridge())
    with pytest.raises(VerispecError, match="chains and static trees"):
        cross.propose_tree([1, 2], TreeShape.parse("dynamic:8"), "deterministic", GREEDY, torch.Generator())
    too_long = [1] * (cross.max_len - 2)  # no room for 4 more draft tokens
    assert cross.propose(too_long, 4, GREEDY, torch.Generator()).num_drafts == 0
    tree = cross.propose_tree(too_long, TreeShape.parse("s3_k2_d6"), "iid", GREEDY, torch.Generator())
    assert tree.num_drafts == 0 and tree.tree is None  # a chain of nothing instead of the tree
