"""End to end: sequences sampled by speculative decoding follow the target's exact distribution.

A target with a 4-token vocabulary and a different random draft; for 4-token continuations we compute
the target's exact sequence probabilities by teacher forcing (with the sampling transform applied),
then draw N sequences with the engine (gamma 2, so rounds both accept and reject) and compare:
Pearson chi-square over cells with expected count >= 5 (the rest pooled) must not reject at
p = 1e-4, and the total-variation distance must stay under 2 * E[TV] for multinomial noise
(E[TV] ~ sum_i sqrt(p_i (1 - p_i) / (2 pi N))). A verifier that resamples from p after a rejection
must fail the same test.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from scipy.stats import chisquare

import verispec.engine as engine_module
from broken_verifiers import resample_from_target_after_rejection
from verispec.config import SamplingParams, SpecConfig, StopRules
from verispec.drafters import DraftModelDrafter
from verispec.engine import SpecEngine
from verispec.models.llama import load_checkpoint
from verispec.testing import make_checkpoint

VOCAB, LENGTH, SAMPLES = 4, 4, 2000
PROMPT = [1, 2, 3, 0, 2]


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    target = load_checkpoint(make_checkpoint(root / "t", VOCAB, hidden=32, layers=2, seed=21))
    draft = load_checkpoint(make_checkpoint(root / "d", VOCAB, hidden=16, layers=1, heads=2, kv_heads=1, seed=22))
    return target, draft


def exact_target_distribution(target, sampling: SamplingParams, length: int = LENGTH) -> dict[tuple[int, ...], float]:
    from verispec.sampling import logits_to_probs

    table = {}
    with torch.no_grad():
        for seq in itertools.product(range(VOCAB), repeat=length):
            logits = target.train_forward(torch.tensor([PROMPT + list(seq[:-1])]))[0][0, len(PROMPT) - 1:]
            probs = logits_to_probs(logits, sampling)  # (LENGTH, V): the distribution of each next token
            table[seq] = math.prod(float(probs[i, token]) for i, token in enumerate(seq))
    return table


def sample_sequences(target, draft, sampling, vocab_limit=None, gamma_policy=None, gamma=2, length=LENGTH,
                     samples=SAMPLES):
    engine = SpecEngine(target, DraftModelDrafter(draft, vocab_limit=vocab_limit), gamma_policy=gamma_policy)
    spec = SpecConfig(gamma=gamma, gamma_policy="fixed" if gamma_policy is None else "adaptive")
    counts: dict[tuple[int, ...], int] = {}
    for seed in range(samples):
        tokens = tuple(engine.generate(PROMPT, sampling, spec, StopRules(max_tokens=length), seed=seed).tokens)
        counts[tokens] = counts.get(tokens, 0) + 1
    return counts


def agreement(expected: dict, counts: dict) -> tuple[float, float, float]:
    """(chi-square p-value, TV distance, TV bound)."""
    n = sum(counts.values())
    assert set(counts) <= {k for k, v in expected.items() if v > 0}, "sampled a zero-probability sequence"
    big = [k for k, v in expected.items() if v * n >= 5]
    observed = [counts.get(k, 0) for k in big] + [n - sum(counts.get(k, 0) for k in big)]
    predicted = [expected[k] * n for k in big] + [n - sum(expected[k] * n for k in big)]
    if predicted[-1] < 1e-9:  # no mass outside the big cells (up to float32 rounding of the probabilities)
        observed, predicted = observed[:-1], predicted[:-1]
        predicted = [value * n / sum(predicted) for value in predicted]  # sums agree as chisquare requires
    p_value = chisquare(observed, predicted).pvalue
    tv = 0.5 * sum(abs(counts.get(k, 0) / n - v) for k, v in expected.items())
    mean_tv = sum(math.sqrt(v * (1 - v) / (2 * math.pi * n)) for v in expected.values())
    return p_value, tv, 2 * mean_tv


SETTINGS = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_k=3, top_p=0.9, min_p=0.1)]


@pytest.mark.parametrize("sampling", SETTINGS, ids=["t1", "t0.8-k3-p0.9-min0.1"])
def test_spec_samples_follow_target(tiny_pair, sampling):
    target, draft = tiny_pair
    expected = exact_target_distribution(target, sampling)
    counts = sample_sequences(target, draft, sampling)
    p_value, tv, bound = agreement(expected, counts)
    assert p_value > 1e-4 and tv < bound, (p_value, tv, bound)


@pytest.mark.parametrize("sampling", SETTINGS, ids=["t1", "t0.8-k3-p0.9-min0.1"])
def test_a_draft_limited_to_part_of_the_vocabulary_stays_lossless(tiny_pair, sampling):
    """The draft proposes only ids < 2 (q is 0 on the others): tokens 2 and 3 are never drafted, only
    recovered or bonus, and the samples still follow the target exactly."""
    target, draft = tiny_pair
    expected = exact_target_distribution(target, sampling)
    counts = sample_sequences(target, draft, sampling, vocab_limit=2)
    p_value, tv, bound = agreement(expected, counts)
    assert p_value > 1e-4 and tv < bound, (p_value, tv, bound)


@pytest.mark.parametrize("sampling", SETTINGS, ids=["t1", "t0.8-k3-p0.9-min0.1"])
def test_drafts_per_round_chosen_from_earlier_acceptance_stay_lossless(tiny_pair, sampling):
    """The adaptive policy at batch 1: each round's number of drafts follows the request's earlier
    rounds (+2 after a fully accepted round, -1 otherwise), so it depends on earlier random outcomes;
    every round is still verified exactly, and the sequences still follow the target. Six tokens, so
    that a request has rounds after its first with room for more than one draft."""
    from verispec.adaptive import AdaptiveGamma

    class CheapRounds(AdaptiveGamma):
        """Rounds timed as nearly free drafting, whatever the machine: speculation always pays, so the
        run rule, not the cost model, picks the drafts."""

        def __init__(self):
            super().__init__(max_gamma=3, min_samples=1)
            self.drafted: set[int] = set()

        def observe(self, batch_size, gamma, seconds, accepted, drafted):
            self.drafted.add(drafted[0])
            super().observe(batch_size, gamma, 0.01 + 0.0001 * gamma, accepted, drafted)

    target, draft = tiny_pair
    policy = CheapRounds()
    expected = exact_target_distribution(target, sampling, length=6)
    counts = sample_sequences(target, draft, sampling, gamma_policy=policy, gamma=3, length=6,
                              samples=1200)  # six-token runs are the slowest here
    assert {1, 2, 3} <= policy.drafted  # the depth really moved with the outcomes
    p_value, tv, bound = agreement(expected, counts)
    assert p_value > 1e-4 and tv < bound, (p_value, tv, bound)


@pytest.fixture(scope="module")
def int8_draft(tmp_path_factory):
    """A draft quantized to int8 (``kernels.quantize``): hidden 64, so its layers take AMX-INT8 tiles
    where the CPU has them, and its 4-row head the int8 rows of the AVX2 loop."""
    from verispec import kernels

    if kernels.library() is None:
        pytest.skip(f"no kernel to quantize for here: {kernels.status()}")
    root = tmp_path_factory.mktemp("int8")
    draft = load_checkpoint(make_checkpoint(root / "d", VOCAB, hidden=64, layers=1, heads=4, kv_heads=2, seed=23))
    plain = load_checkpoint(make_checkpoint(root / "p", VOCAB, hidden=64, layers=1, heads=4, kv_heads=2, seed=23))
    assert kernels.quantize(draft) > 0
    cache, plain_cache = draft.new_cache(1), plain.new_cache(1)
    with torch.inference_mode():
        quantized = draft(torch.tensor([PROMPT]), cache, last_only=True)
        floats = plain(torch.tensor([PROMPT]), plain_cache, last_only=True)
    assert not torch.equal(quantized, floats)  # the draft's q really is the quantized model's
    return draft


@pytest.mark.parametrize("sampling", SETTINGS, ids=["t1", "t0.8-k3-p0.9-min0.1"])
def test_an_int8_draft_stays_lossless(tiny_pair, int8_draft, sampling):
    """Quantizing the draft changes what it proposes, never what is committed."""
    target, _ = tiny_pair
    expected = exact_target_distribution(target, sampling)
    p_value, tv, bound = agreement(expected, sample_sequences(target, int8_draft, sampling))
    assert p_value > 1e-4 and tv < bound, (p_value, tv, bound)


def test_broken_verifier_fails_the_same_test(tiny_pair, monkeypatch):
    target, draft = tiny_pair
    sampling = SETTINGS[0]
    expected = exact_target_distribution(target, sampling)
    monkeypatch.setattr(engine_module, "verify_chain", resample_from_target_after_rejection)
    p_value, tv, bound = agreement(expected, sample_sequences(target, draft, sampling))
    assert p_value < 1e-4 or tv > bound, (p_value, tv, bound)


class PieceTokenizer:
    """A tokenizer over a fixed list of strings (greedy longest match), enough for a ``VocabBridge``."""

    def __init__(self, pieces: list[str]):
        self.pieces = pieces

    def get_vocab(self) -> dict[str, int]:
        return {piece: index for index, piece in enumerate(self.pieces)}

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids, at = [], 0
        while at < len(text):
            piece = max((p for p in self.pieces if text.startswith(p, at)), key=len)
            ids.append(self.pieces.index(piece))
            at += len(piece)
        return ids


# The target's 4 tokens and a draft vocabulary sharing three of them: the target's "ab" is never drafted,
# the draft's "ba" and "d" never proposed, and the draft reads "ab" as "a", "b".
TARGET_PIECES, DRAFT_PIECES = ["a", "b", "ab", "c"], ["c", "ba", "a", "d", "b"]


@pytest.fixture(scope="module")
def cross_vocab(tmp_path_factory):
    from verispec.vocab import VocabBridge

    root = tmp_path_factory.mktemp("cross")
    draft = load_checkpoint(make_checkpoint(root / "d", len(DRAFT_PIECES), hidden=16, layers=1, heads=2, kv_heads=1,
                                            seed=24))
    bridge = VocabBridge.build(PieceTokenizer(TARGET_PIECES), PieceTokenizer(DRAFT_PIECES), VOCAB, len(DRAFT_PIECES))
    assert bridge.shared == 3 and int(bridge.to_draft[2]) == -1
    return draft, bridge


def sample_cross_vocab(target, drafter, sampling):
    engine = SpecEngine(target, drafter)
    counts: dict[tuple[int, ...], int] = {}
    accepted = 0
    for seed in range(SAMPLES):
        result = engine.generate(PROMPT, sampling, SpecConfig(gamma=2), StopRules(max_tokens=LENGTH), seed=seed)
        counts[tuple(result.tokens)] = counts.get(tuple(result.tokens), 0) + 1
        accepted += result.stats.accepted
    assert accepted > SAMPLES // 4  # the draft's proposals really were accepted, not just replaced
    return counts


@pytest.mark.parametrize("sampling", SETTINGS, ids=["t1", "t0.8-k3-p0.9-min0.1"])
def test_a_draft_with_another_tokenizer_stays_lossless(tiny_pair, cross_vocab, sampling):
    """Token-level intersection: the draft drafts over the shared tokens (q 0 on the target's "ab"),
    reading the committed text in its own tokens."""
    from verispec.drafters.cross_vocab import CrossVocabDrafter

    target, _ = tiny_pair
    draft, bridge = cross_vocab
    expected = exact_target_distribution(target, sampling)
    p_value, tv, bound = agreement(expected, sample_cross_vocab(target, CrossVocabDrafter(draft, bridge), sampling))
    assert p_value > 1e-4 and tv < bound, (p_value, tv, bound)


def test_a_cross_vocabulary_q_before_the_intersection_fails_the_same_test(tiny_pair, cross_vocab):
    """A drafter that samples from the shared tokens but reports 0.6 of that q (as a q read off the
    draft's whole softmax would be, with 40% of its mass on tokens the target lacks) is caught."""
    from verispec.drafters.base import Proposal
    from verispec.drafters.cross_vocab import CrossVocabDrafter

    class UnrestrictedQ(CrossVocabDrafter):
        def propose(self, context, num_drafts, sampling, generator):
            proposal = super().propose(context, num_drafts, sampling, generator)
            if proposal.probs is None:
                return proposal
            return Proposal(proposal.tokens, proposal.probs * 0.6)

    target, _ = tiny_pair
    draft, bridge = cross_vocab
    sampling = SETTINGS[0]
    expected = exact_target_distribution(target, sampling)
    p_value, tv, bound = agreement(expected, sample_cross_vocab(target, UnrestrictedQ(draft, bridge), sampling))
    assert p_value < 1e-4 or tv > bound, (p_value, tv, bound)
