"""verispec.vocab and the cross-vocabulary drafter: bytes per token, the bridge between two tokenizers,
and a draft whose ids are a permutation of the target's drafting exactly what the same-tokenizer draft
drafts (the statistical losslessness tests are in test_engine_statistical.py)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from verispec.config import SamplingParams, SpecConfig, StopRules
from verispec.drafters.cross_vocab import CrossVocabDrafter
from verispec.errors import CheckpointError, VerispecError
from verispec.loading import DEFAULT_DRAFT, build_engine, embedded_pair_available, load_pair, load_tokenizer
from verispec.vocab import VocabBridge, byte_level_alphabet, token_bytes

pytestmark = pytest.mark.skipif(not embedded_pair_available(), reason="the embedded tiny pair is not installed")


class Pieces:
    def __init__(self, pieces):
        self.pieces = pieces

    def get_vocab(self):
        return {piece: index for index, piece in enumerate(self.pieces)}

    def encode(self, text, add_special_tokens=False):
        return [self.pieces.index(char) for char in text]


def test_byte_level_alphabet_is_a_bijection_onto_bytes():
    alphabet = byte_level_alphabet()
    assert sorted(alphabet.values()) == list(range(256))
    assert alphabet["A"] == ord("A") and alphabet["\u0120"] == ord(" ") and alphabet["\u010a"] == ord("\n")


def test_token_bytes_agree_with_the_tokenizers_own_decoding():
    tokenizer = load_tokenizer(DEFAULT_DRAFT)
    data = token_bytes(tokenizer, 8192)
    assert data[0] == b"<|endoftext|>"  # a special token is its own text
    checked = 0
    for index in range(5, 8192):
        text = tokenizer.decode([index])
        if "\ufffd" not in text:  # a piece of a multi-byte character decodes to U+FFFD
            assert data[index].decode() == text, index
            checked += 1
    assert checked > 7000


def test_bridge_spreads_shared_logits_and_masks_the_rest():
    bridge = VocabBridge.build(Pieces(list("abcd")), Pieces(list("xcay")), target_vocab=4, draft_vocab=4)
    assert bridge.shared == 2
    assert bridge.to_draft.tolist() == [2, -1, 1, -1]
    spread = bridge.spread(torch.tensor([10.0, 11.0, 12.0, 13.0]))
    assert spread[0] == 12.0 and spread[2] == 11.0 and torch.isinf(spread[[1, 3]]).all()
    head = bridge.spread(torch.tensor([10.0, 11.0]))  # a head scoring only the draft's first 2 ids
    assert head[2] == 11.0 and torch.isinf(head[[0, 1, 3]]).all()
    assert bridge.draft_context([0, 2, 2]) == [2, 1, 1]  # "acc" in the draft's ids


def test_bridge_refuses_tokenizers_that_share_nothing():
    with pytest.raises(CheckpointError, match="shares no token"):
        VocabBridge.build(Pieces(list("ab")), Pieces(list("xy")), target_vocab=2, draft_vocab=2)


@pytest.fixture(scope="module")
def permuted_draft(tmp_path_factory):
    """The embedded draft with its ordinary tokens' ids shuffled (tokenizer and embedding rows alike):
    the same model under another token -> id map."""
    folder = tmp_path_factory.mktemp("permuted") / "draft"
    shutil.copytree(DEFAULT_DRAFT, folder)
    generator = torch.Generator().manual_seed(0)
    order = torch.cat([torch.arange(5), 5 + torch.randperm(8192 - 5, generator=generator)])  # new id -> old id
    new_id = torch.empty_like(order)
    new_id[order] = torch.arange(order.numel())
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    tokenizer["model"]["vocab"] = {token: int(new_id[index]) for token, index in tokenizer["model"]["vocab"].items()}
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    weights = load_file(folder / "model.safetensors")
    weights["model.embed_tokens.weight"] = weights["model.embed_tokens.weight"][order].contiguous()
    save_file(weights, folder / "model.safetensors")
    return folder


def test_a_permuted_tokenizer_drafts_exactly_what_the_same_tokenizer_drafts(permuted_draft):
    """Greedy text is the tokenizer's own tokenization, so the draft reads the same tokens either way
    (sampled tokens need not be: "re" + "turn" is re-read as "return", so sampled drafts may differ)."""
    sampling = SamplingParams(temperature=0.0)
    same, bridged = load_pair("tiny"), load_pair("tiny", permuted_draft)
    assert same.bridge is None and bridged.bridge is not None and bridged.bridge.shared == 8192
    spec = SpecConfig(gamma=4)
    prompt = same.tokenizer.encode("def parse(text):\n    return", add_special_tokens=False)
    results = [build_engine(pair, spec).generate(prompt, sampling, spec, StopRules(max_tokens=48), seed=3)
               for pair in (same, bridged)]
    assert isinstance(build_engine(bridged, spec).drafter, CrossVocabDrafter)
    assert results[0].tokens == results[1].tokens
    assert [r.accepted for r in results[0].stats.rounds] == [r.accepted for r in results[1].stats.rounds]
    assert results[0].stats.accepted > 0


def test_cross_vocabulary_trees_and_refusals(permuted_draft):
    pair = load_pair("tiny", permuted_draft)
    prompt = pair.tokenizer.encode("The", add_special_tokens=False)
    greedy, stop = SamplingParams(temperature=0.0), StopRules(max_tokens=24)
    plain = build_engine(pair, SpecConfig(method="none")).generate(prompt, greedy, SpecConfig(method="none"), stop)
    static = SpecConfig(method="tree", tree="s3_k2_d6")
    assert build_engine(pair, static).generate(prompt, greedy, static, stop).tokens == plain.tokens
    dynamic = SpecConfig(method="tree", tree="dynamic:8")
    with pytest.raises(VerispecError, match="static shape"):
        build_engine(pair, dynamic).generate(prompt, greedy, dynamic, stop)
    # The batched engine (serve, audit, bench) lends each row a drafter through the bridge: each request's
    # tokens are those it gets alone.
    from verispec.batch import BatchEngine, BatchRequest
    from verispec.drafters.cross_vocab import CrossVocabDrafter
    from verispec.loading import row_drafter

    sampled = SamplingParams(temperature=1.0, top_k=20)
    for spec in (SpecConfig(gamma=4), static):
        assert isinstance(row_drafter(pair, spec)(), CrossVocabDrafter)
        engine = BatchEngine(pair.target, pair.draft, spec, max_batch=2, max_len=128,
                             make_drafter=row_drafter(pair, spec))
        requests = [BatchRequest("g", prompt, greedy, stop), BatchRequest("s", prompt, sampled, stop, seed=5)]
        tokens = {r.request_id: [t for e in engine.add(r) for t in e.tokens] for r in requests}
        while engine.active:
            for event in engine.step():
                tokens[event.request_id] += event.tokens
        for request in requests:
            alone = build_engine(pair, spec).generate(prompt, request.sampling, spec, stop, seed=request.seed)
            assert tokens[request.request_id] == alone.tokens
    with pytest.raises(CheckpointError, match="differs from the target's"):
        load_pair("tiny", permuted_draft, cross_vocab=False)
