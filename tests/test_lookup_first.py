"""Lookup first (``--lookup N``): a repeat of the context drafts the repeat, other rounds ask the drafter;
greedy output equals plain decoding alone and batched, sampled sequences follow the target, and the
option is refused where it means nothing."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest
import torch

from test_batch import models, run_batched  # noqa: F401 (fixture)
from test_batch_drafters import drafter_for, head  # noqa: F401 (fixture)
from test_engine import plain
from test_engine_statistical import SETTINGS, agreement, exact_target_distribution, tiny_pair  # noqa: F401
from verispec.batch import BatchEngine, BatchRequest
from verispec.bench.config import SpecSettings, parse_variant
from verispec.config import SamplingParams, SpecConfig, StopRules
from verispec.drafters import DraftModelDrafter
from verispec.drafters.base import DrafterBase, Proposal
from verispec.drafters.lookup_first import LookupFirst
from verispec.engine import SpecEngine
from verispec.errors import SamplingError

GREEDY = SamplingParams(temperature=0)


class Recorder(DrafterBase):
    """An inner drafter that always proposes token 7 and records what it was asked."""

    def __init__(self):
        self.asked: list[tuple[int, int]] = []  # (context length, num_drafts)
        self.commits = 0

    def reset(self):
        self.asked, self.commits = [], 0

    def commit(self, context):
        self.commits += 1

    def propose(self, context, num_drafts, sampling, generator):
        self.asked.append((len(context), num_drafts))
        return Proposal(torch.full((num_drafts,), 7, dtype=torch.long), None)


def test_a_repeat_drafts_what_followed_it_and_anything_else_asks_the_drafter():
    inner = Recorder()
    drafter = LookupFirst(inner, min_n=2)
    repeat = drafter.propose([1, 2, 3, 4, 5, 1, 2], 3, GREEDY, None)
    assert repeat.tokens.tolist() == [3, 4, 5] and repeat.probs is None and drafter.looked_up
    assert inner.asked == []  # the drafter was not asked
    fresh = drafter.propose([1, 2, 3, 4, 5, 9, 2], 3, GREEDY, None)  # "9 2" never occurred: no repeat of 2+
    assert fresh.tokens.tolist() == [7, 7, 7] and inner.asked == [(7, 3)] and not drafter.looked_up
    drafter.commit([1, 2, 3])
    assert inner.commits == 1  # commits always reach the drafter (its state follows the context)
    assert drafter.lookups == 1
    drafter.reset()
    assert drafter.lookups == 0 and inner.asked == []


def test_one_shared_token_is_not_a_repeat_at_the_default_length():
    inner = Recorder()
    LookupFirst(inner).propose([5, 6, 7, 8, 6], 2, GREEDY, None)  # "6" recurs, but one token is weak evidence
    assert inner.asked == [(5, 2)]


@pytest.mark.parametrize("drafter", ["model", "eagle", "early_exit"])
def test_greedy_output_equals_plain_decoding(models, head, drafter):  # noqa: F811
    target, draft = models
    spec = SpecConfig(gamma=3, drafter=drafter, lookup=2, exit_layer=1)
    prompt = [3, 14, 15, 9, 26, 5, 3, 14, 15, 9, 26, 5, 3, 14]  # repeats: some rounds look up
    engine = SpecEngine(target, LookupFirst(drafter_for(spec, target, draft, head), min_n=2))
    result = engine.generate(prompt, GREEDY, spec, StopRules(max_tokens=40))
    assert result.tokens == plain(target, prompt, max_tokens=40).tokens
    assert engine.drafter.lookups > 0 and result.stats.drafted > engine.drafter.lookups  # both kinds of rounds


@pytest.mark.parametrize("sampling", [GREEDY, SamplingParams(temperature=1.0, top_k=8)], ids=["greedy", "sampled"])
@pytest.mark.parametrize("drafter", ["model", "eagle"])
def test_batched_rows_decode_as_each_would_alone(models, head, drafter, sampling):  # noqa: F811
    """Through the server's engine (the batched draft drafts for the rows without a repeat): every request
    gets the tokens it gets alone with LookupFirst over its own drafter, sampled ones included, and
    greedy ones equal plain decoding (a batch of 4 over 10 requests)."""
    target, draft = models
    spec = SpecConfig(gamma=3, drafter=drafter, lookup=2)
    rng = random.Random(3)
    queue = []
    for i in range(10):
        motif = [rng.randrange(64) for _ in range(4)]
        queue.append(BatchRequest(str(i), motif * 3 + [rng.randrange(64)], sampling, StopRules(max_tokens=12),
                                  seed=i))
    engine = BatchEngine(target, draft, spec, max_batch=4, eagle=head)
    assert engine.draft is not None and engine.lookup is not None
    hits, lookup = [], engine.lookup.lookup
    engine.lookup.lookup = lambda context, count: hits.append(lookup(context, count)) or hits[-1]
    out, finished = run_batched(engine, queue)
    assert any(hits) and not all(hits)  # rounds of both kinds
    assert len(finished) == len(queue)
    rounds = [r for event in finished.values() for r in event.stats.rounds]
    for request in queue:
        solo = SpecEngine(target, LookupFirst(drafter_for(spec, target, draft, head), min_n=2))
        alone = solo.generate(request.prompt_ids, sampling, spec, request.stop, seed=request.seed).tokens
        assert out[request.request_id] == alone
        if sampling.greedy:
            assert alone == plain(target, request.prompt_ids, max_tokens=12).tokens
    assert sum(r.drafted for r in rounds) > 0


@pytest.mark.parametrize("gamma, lookup_drafts", [(2, 0), (1, 2)], ids=["gamma", "past-gamma"])
@pytest.mark.parametrize("sampling", SETTINGS, ids=["t1", "t0.8-k3-p0.9-min0.1"])
def test_sampled_sequences_follow_the_target(tiny_pair, sampling, gamma, lookup_drafts):  # noqa: F811
    """Rounds of point-mass lookups (any shared token counts: min_n 1 over a 4-token vocabulary) and rounds
    of the draft model's sampled drafts, mixed within requests: the sequences still follow the target,
    also where lookups draft past gamma (--lookup-drafts 2 at gamma 1, cut at the request's budget)."""
    target, draft = tiny_pair
    expected = exact_target_distribution(target, sampling)
    drafter = LookupFirst(DraftModelDrafter(draft), min_n=1, max_n=2, lookup_drafts=lookup_drafts)
    engine = SpecEngine(target, drafter)
    spec = SpecConfig(gamma=gamma, lookup=1, lookup_drafts=lookup_drafts)
    counts, lookups, drafted, widest = {}, 0, 0, 0
    for seed in range(2000):
        result = engine.generate([1, 2, 3, 0, 2], sampling, spec, StopRules(max_tokens=4), seed=seed)
        counts[tuple(result.tokens)] = counts.get(tuple(result.tokens), 0) + 1
        lookups += drafter.lookups
        drafted += len(result.stats.rounds)
        widest = max([widest] + [r.drafted for r in result.stats.rounds])
    assert 0 < lookups < drafted  # both kinds of rounds ran
    assert widest == 2  # at gamma 2, or past gamma 1 where lookups may draft 2
    p_value, tv, bound = agreement(expected, counts)
    assert p_value > 1e-4 and tv < bound, (p_value, tv, bound)


def test_lookup_is_refused_where_it_means_nothing():
    with pytest.raises(SamplingError, match="--tree"):
        SpecConfig(method="tree", lookup=3)
    with pytest.raises(SamplingError, match="drop --lookup"):
        SpecConfig(drafter="ngram", lookup=3)
    with pytest.raises(SamplingError, match=">= 0"):
        SpecConfig(lookup=-1)
    run = subprocess.run([sys.executable, "-m", "verispec.cli", "generate", "hi", "--target", "tiny", "--tree",
                          "s3_k2_d6", "--lookup", "3"], capture_output=True, text=True)
    assert run.returncode == 2 and "Traceback" not in run.stderr and len(run.stderr.strip().splitlines()) == 1


def test_bench_variants_name_the_lookup():
    variant = parse_variant("eagle+3:2", SpecSettings())
    assert variant.spec.drafter == "eagle" and variant.spec.lookup == 3 and variant.spec.gamma == 2
    assert parse_variant("self+2@3", SpecSettings()).spec.exit_layer == 3
    assert parse_variant("chain:2", SpecSettings()).spec.lookup == 0
    wide = parse_variant("eagle+3/6:2", SpecSettings()).spec
    assert (wide.lookup, wide.lookup_drafts, wide.gamma) == (3, 6, 2)
    with pytest.raises(Exception, match="lookup first"):
        parse_variant("eagle+3/x:2", SpecSettings())
    with pytest.raises(Exception, match="lookup first"):
        parse_variant("ngram+3:2", SpecSettings())


def test_a_lookup_can_draft_past_the_rounds_gamma():
    """--lookup-drafts L: a repeat drafts up to max(gamma, L) tokens; the drafter keeps the round's number;
    a round that asks for nothing drafts nothing."""
    inner = Recorder()
    drafter = LookupFirst(inner, min_n=2, lookup_drafts=5)
    context = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2]
    assert drafter.propose(context, 2, GREEDY, None).tokens.tolist() == [3, 4, 5, 6, 7]
    assert drafter.propose(context, 7, GREEDY, None).tokens.tolist() == [3, 4, 5, 6, 7, 8, 1]
    assert drafter.propose(context, 0, GREEDY, None).num_drafts == 0
    assert drafter.propose([1, 2, 3, 4, 5, 6, 9, 2], 2, GREEDY, None).tokens.tolist() == [7, 7]
    assert inner.asked == [(10, 0), (8, 2)]


def test_a_chain_proposal_is_cut_to_what_the_request_can_commit():
    proposal = Proposal(torch.tensor([4, 5, 6, 7]), torch.full((4, 9), 1 / 9))
    cut = proposal.capped(3)
    assert cut.tokens.tolist() == [4, 5] and cut.probs.shape == (2, 9)
    assert proposal.capped(5) is proposal and proposal.capped(0).num_drafts == 0


def _long_repeats(seed: int, count: int) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        motif = [rng.randrange(64) for _ in range(7)]
        prompts.append(motif * 3 + motif[:3])
    return prompts


@pytest.mark.parametrize("drafter", ["model", "eagle"])
def test_long_lookups_decode_as_plain_within_the_budget(models, head, drafter, monkeypatch):  # noqa: F811
    """gamma 2 with --lookup-drafts 8 over prompts that repeat 7-token motifs (the test models' greedy
    outputs fall into loops, which lookups draft far): some rounds verify more than gamma drafts, none
    more than the request can still commit (lengths 23 and 37 end inside loops), and the tokens equal
    plain decoding, alone (SpecEngine) and batched (BatchEngine, 4 rows)."""
    target, draft = models
    spec = SpecConfig(gamma=2, drafter=drafter, lookup=2, lookup_drafts=8)
    prompts = _long_repeats(5, 6)
    cuts, capped = [], Proposal.capped
    monkeypatch.setattr(Proposal, "capped", lambda self, remaining: cuts.append(self.num_drafts >= remaining)
                        or capped(self, remaining))
    longest = 0
    for index, prompt in enumerate(prompts):
        max_tokens = (23, 37)[index % 2]
        engine = SpecEngine(target, LookupFirst(drafter_for(spec, target, draft, head), min_n=2, lookup_drafts=8))
        result = engine.generate(prompt, GREEDY, spec, StopRules(max_tokens=max_tokens))
        assert result.tokens == plain(target, prompt, max_tokens=max_tokens).tokens
        longest = max(longest, max(r.drafted for r in result.stats.rounds))
    assert longest > spec.gamma and any(cuts)  # lookups past gamma, and some cut at the budget
    queue = [BatchRequest(str(i), p, GREEDY, StopRules(max_tokens=(23, 37)[i % 2])) for i, p in enumerate(prompts)]
    engine = BatchEngine(target, draft, spec, max_batch=4, eagle=head)
    out, finished = run_batched(engine, queue)
    rounds = [r for event in finished.values() for r in event.stats.rounds]
    assert max(r.drafted for r in rounds) > spec.gamma
    for request in queue:
        assert out[request.request_id] == plain(target, request.prompt_ids, max_tokens=request.stop.max_tokens).tokens


def test_lookup_drafts_need_a_lookup():
    with pytest.raises(SamplingError, match="needs --lookup"):
        SpecConfig(lookup_drafts=4)
    with pytest.raises(SamplingError, match="0..64"):
        SpecConfig(lookup=3, lookup_drafts=65)
    run = subprocess.run([sys.executable, "-m", "verispec.cli", "generate", "hi", "--target", "tiny",
                          "--lookup-drafts", "6"], capture_output=True, text=True)
    assert run.returncode == 2 and "Traceback" not in run.stderr and "--lookup" in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1
