"""Engine: greedy spec == plain token for token, KV invariant, stop rules, streaming, statistics."""

from __future__ import annotations

import pytest
import torch

from verispec.adaptive import GammaPolicyBase
from verispec.config import SamplingParams, SpecConfig, StopRules
from verispec.drafters import DraftModelDrafter
from verispec.engine import SpecEngine
from verispec.errors import ContextError, SamplingError
from verispec.models.llama import load_checkpoint

GREEDY = SamplingParams(temperature=0.0)
PROMPT = [3, 14, 15, 9, 26, 5]


@pytest.fixture(scope="module")
def models(checkpoints):
    return {name: load_checkpoint(path) for name, path in checkpoints.items()}


def plain(target, prompt=PROMPT, max_tokens=40, sampling=GREEDY, seed=0):
    return SpecEngine(target).generate(prompt, sampling, SpecConfig(method="none"),
                                       StopRules(max_tokens=max_tokens), seed=seed)


@pytest.mark.parametrize("target_name,draft_name", [("llama", "draft"), ("qwen2", "draft_qwen2"),
                                                    ("llama_tied", "draft"), ("qwen2", "llama")])
@pytest.mark.parametrize("gamma", [1, 2, 3, 5, 8])
def test_greedy_spec_equals_plain(models, target_name, draft_name, gamma):
    target = models[target_name]
    reference = plain(target)
    engine = SpecEngine(target, DraftModelDrafter(models[draft_name]))
    result = engine.generate(PROMPT, GREEDY, SpecConfig(gamma=gamma), StopRules(max_tokens=40))
    assert result.tokens == reference.tokens
    assert result.stats.generated_tokens == 40


@pytest.mark.parametrize("name", ["llama", "qwen2"])
@pytest.mark.parametrize("gamma", [1, 4, 8])
def test_draft_equal_to_target_accepts_everything(models, name, gamma):
    target = models[name]
    engine = SpecEngine(target, DraftModelDrafter(target))
    result = engine.generate(PROMPT, GREEDY, SpecConfig(gamma=gamma), StopRules(max_tokens=37))
    assert result.tokens == plain(target, max_tokens=37).tokens
    rounds = result.stats.rounds
    assert result.stats.acceptance_rate == 1.0
    # Every round but the last commits gamma + 1; the last is shortened only by max_tokens.
    assert all(r.committed == gamma + 1 for r in rounds[:-1])
    assert 1 <= rounds[-1].committed <= gamma + 1


def test_draft_equal_to_target_accepts_everything_when_sampling(models):
    """p == q: acceptance is certain under any sampling transform (no 0/0 residual)."""
    target = models["llama"]
    engine = SpecEngine(target, DraftModelDrafter(target))
    for params in [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05)]:
        result = engine.generate(PROMPT, params, SpecConfig(gamma=4), StopRules(max_tokens=30), seed=11)
        assert result.stats.acceptance_rate == 1.0


def assert_cache_matches_fresh_prefill(model, cache, tokens):
    fresh = model.new_cache(1, cache.max_len)
    model.forward(torch.tensor([tokens]), fresh)
    n = len(tokens)
    assert cache.lengths[0] == n
    assert torch.allclose(cache.keys[:, 0, :, :n], fresh.keys[:, 0, :, :n], atol=1e-5)
    assert torch.allclose(cache.values[:, 0, :, :n], fresh.values[:, 0, :, :n], atol=1e-5)


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_p=0.9)])
def test_kv_cache_equals_fresh_prefill_after_rounds(models, params):
    """Invariant (docs/algorithms.md, KV state follows the committed path): after any rounds the
    target cache holds exactly the committed prefix (all committed tokens but the last, which is fed
    next round); the draft cache likewise."""
    target, draft = models["llama"], models["draft"]
    drafter = DraftModelDrafter(draft)
    engine = SpecEngine(target, drafter)
    generation = engine.stream(PROMPT, params, SpecConfig(gamma=3), StopRules(max_tokens=200), seed=5)
    for count, _ in enumerate(generation):
        if count == 12:
            break
    assert any(r.accepted < r.drafted for r in generation.stats.rounds), "want some rejections"
    assert_cache_matches_fresh_prefill(target, generation.cache, generation.context[:-1])
    assert drafter.seen == generation.context[:len(drafter.seen)]
    assert_cache_matches_fresh_prefill(draft, drafter.cache, drafter.seen)


def test_streaming_chunks_concatenate_to_result(models):
    engine = SpecEngine(models["llama"], DraftModelDrafter(models["draft"]))
    generation = engine.stream(PROMPT, SamplingParams(temperature=1.0), SpecConfig(gamma=4), StopRules(max_tokens=50), seed=3)
    chunks = list(generation)
    assert [t for c in chunks for t in c] == generation.result.tokens
    assert len(chunks) == len(generation.result.stats.rounds) + 1  # the first token is its own chunk
    again = engine.generate(PROMPT, SamplingParams(temperature=1.0), SpecConfig(gamma=4), StopRules(max_tokens=50), seed=3)
    assert again.tokens == generation.result.tokens  # seeded runs reproduce


def test_eos_ends_round_and_nothing_after_is_committed(models):
    target = models["llama"]
    reference = plain(target, max_tokens=40).tokens
    eos = reference[10]  # pretend the 11th token is EOS
    first = reference.index(eos)
    engine = SpecEngine(target, DraftModelDrafter(target))  # all drafts accepted: EOS lands mid-round
    result = engine.generate(PROMPT, GREEDY, SpecConfig(gamma=4), StopRules(max_tokens=40, eos_ids=(eos,)))
    assert result.tokens == reference[:first + 1]
    assert result.finish_reason == "stop"
    ignored = engine.generate(PROMPT, GREEDY, SpecConfig(gamma=4),
                              StopRules(max_tokens=40, eos_ids=(eos,), ignore_eos=True))
    assert ignored.tokens == reference and ignored.finish_reason == "length"


def test_stop_string_cuts_output(models):
    target = models["llama"]
    decode = lambda ids: "".join(chr(65 + i % 26) for i in ids)
    reference = plain(target, max_tokens=30).tokens
    stop_text = decode(reference)[12:14]
    engine = SpecEngine(target, DraftModelDrafter(models["draft"]), decode=decode)
    result = engine.generate(PROMPT, GREEDY, SpecConfig(gamma=4), StopRules(max_tokens=30, stop_strings=(stop_text,)))
    text = decode(result.tokens)
    assert result.finish_reason == "stop"
    assert stop_text in text and stop_text not in text[:-1]  # cut at the first token completing it
    assert text[:result.stop_text_index] + stop_text == text[:result.stop_text_index + len(stop_text)]


def test_statistics_are_consistent(models):
    engine = SpecEngine(models["llama"], DraftModelDrafter(models["draft"]))
    result = engine.generate(PROMPT, SamplingParams(temperature=1.0), SpecConfig(gamma=4), StopRules(max_tokens=60), seed=1)
    stats = result.stats
    summary = stats.summary()
    assert sum(r.committed for r in stats.rounds) + 1 == stats.generated_tokens == 60
    assert summary["drafted"] == sum(r.drafted for r in stats.rounds)
    assert summary["acceptance_rate"] == pytest.approx(stats.accepted / stats.drafted)
    assert sum(summary["acceptance_histogram"]) == len(stats.rounds)
    uncond = summary["per_position_acceptance"]["unconditional"]
    assert all(a >= b - 1e-12 for a, b in zip(uncond, uncond[1:]))  # accepting i+1 implies accepting i
    assert len(stats.token_gaps_s) == stats.generated_tokens
    assert summary["ttft_ms"] > 0 and summary["tokens_per_s"] > 0


def test_bad_requests_raise_user_errors(models):
    target = models["llama"]
    engine = SpecEngine(target)
    with pytest.raises(ContextError, match="exceeds the model's context"):
        engine.generate(list(range(10)) * 60, GREEDY, SpecConfig(method="none"), StopRules(max_tokens=10))
    with pytest.raises(SamplingError):
        SamplingParams(temperature=-1)
    with pytest.raises(SamplingError):
        StopRules(max_tokens=0)
    with pytest.raises(SamplingError):
        SpecConfig(gamma=0)


@pytest.mark.parametrize("policy_name", ["adaptive", "hf"])
def test_gamma_policies_keep_greedy_outputs(models, policy_name):
    from verispec.adaptive import make_policy

    target = models["llama"]
    policy = make_policy(policy_name, 6)
    engine = SpecEngine(target, DraftModelDrafter(models["draft"]), gamma_policy=policy)
    spec = SpecConfig(gamma=6, gamma_policy=policy_name)
    drafted = set()
    for _ in range(2):  # the policy's measurements carry over between requests
        result = engine.generate(PROMPT, GREEDY, spec, StopRules(max_tokens=40))
        assert result.tokens == plain(target).tokens
        drafted |= {r.drafted for r in result.stats.rounds}
    # Gamma really changed between rounds (in either request: which rounds change it depends on timing).
    assert len(drafted) > 1


def test_common_prefix_length_matches_a_plain_scan():
    import random

    from verispec.drafters.base import common_prefix_length

    def scan(a, b):
        n = min(len(a), len(b))
        return next((i for i in range(n) if a[i] != b[i]), n)

    rng = random.Random(0)
    for _ in range(5000):
        a = [rng.randint(0, 2) for _ in range(rng.randint(0, 12))]
        b = [rng.randint(0, 2) for _ in range(rng.randint(0, 12))]
        if rng.random() < 0.5:
            b = a[:rng.randint(0, len(a))] + b  # share a prefix often, as caches and contexts do
        assert common_prefix_length(a, b) == scan(a, b)


def test_policy_is_not_charged_for_the_drafts_backlog(models):
    """A round that first feeds the draft a backlog (the prompt, or tokens committed at gamma 0) is
    reported to the gamma policy without that catch-up: it is not what the round's gamma costs."""

    class Recording(GammaPolicyBase):
        def __init__(self, gammas):
            self.gammas, self.seen, self.charged = gammas, [], []

        def choose(self, batch_size, request=None):
            return self.gammas[min(len(self.seen), len(self.gammas) - 1)]

        def observe(self, batch_size, gamma, seconds, accepted, drafted):
            self.seen.append((gamma, seconds))

        def charge(self, batch_size, seconds, prompts=1):
            self.charged.append((len(self.seen), seconds))

    drafter = DraftModelDrafter(models["draft"])
    policy = Recording([2, 2, 0, 0, 0, 0, 2, 2, 2])
    engine = SpecEngine(models["llama"], drafter, gamma_policy=policy)
    prompt = [3 + i % 20 for i in range(120)]  # a long prompt: the first round's catch-up is a real backlog
    result = engine.generate(prompt, GREEDY, SpecConfig(gamma=2, gamma_policy="adaptive"),
                             StopRules(max_tokens=30, ignore_eos=True))
    rounds = result.stats.rounds
    assert [g for g, _ in policy.seen] == [r.drafted for r in rounds]
    charged = [seconds for _, seconds in policy.seen]
    backlog = {0, 6}  # after the prompt, and after four rounds at gamma 0 (5+ committed tokens unseen)
    for index, (record, seconds) in enumerate(zip(rounds, charged)):
        if index in backlog:
            assert seconds < record.total_s - 1e-6, index
        else:
            assert seconds == pytest.approx(record.total_s), index
    assert result.tokens == plain(models["llama"], prompt, 30).tokens[:len(result.tokens)]
    # Only the prompt's read is charged to speculation (before round 0 is observed); the backlog
    # after gamma 0 is a one-off cost of switching back, left out of both.
    assert len(policy.charged) == 1 and policy.charged[0][0] == 0
    assert policy.charged[0][1] == pytest.approx(rounds[0].total_s - charged[0])


@pytest.mark.parametrize("tree", ["s3_k2_d6", "dynamic:8"])
def test_trees_at_the_context_limit(models, tree):
    """prompt + max_tokens equal to the model's context: the last rounds draft what still fits instead of
    writing a whole tree past the cache, and greedy output still equals plain decoding."""
    from verispec.drafters import DraftModelDrafter

    target, draft = models["llama"], models["draft"]
    room = target.config.max_context
    prompt = (PROMPT * room)[:room - 13]
    expected = plain(target, prompt, max_tokens=13).tokens
    spec = SpecConfig(method="tree", tree=tree)
    result = SpecEngine(target, DraftModelDrafter(draft)).generate(prompt, GREEDY, spec, StopRules(max_tokens=13))
    assert result.tokens == expected and len(result.tokens) == 13


@pytest.mark.parametrize("method", ["chain", "s3_k2_d6", "dynamic:8", "ngram", "self"])
def test_every_other_drafter_at_the_context_limit(models, method):
    """The EAGLE head (chains and trees), n-gram and self-speculation at prompt + max_tokens = the
    model's context: greedy output equals plain decoding and nothing is written past the caches."""
    from verispec.drafters import EarlyExitDrafter, NgramDrafter
    from verispec.drafters.eagle import EagleDrafter
    from verispec.models.eagle import EagleHead

    target = models["llama"]
    room = target.config.max_context
    prompt = (PROMPT * room)[:room - 13]
    expected = plain(target, prompt, max_tokens=13).tokens
    if method == "ngram":
        drafter, spec = NgramDrafter(), SpecConfig(gamma=4, drafter="ngram")
    elif method == "self":
        drafter, spec = EarlyExitDrafter(target, 1), SpecConfig(gamma=4, drafter="early_exit", exit_layer=1)
    else:
        head = EagleHead.for_target(target, target.config.vocab_size).eval()
        drafter = EagleDrafter(head, room)
        spec = SpecConfig(gamma=4, drafter="eagle") if method == "chain" else \
            SpecConfig(method="tree", tree=method, drafter="eagle")
    result = SpecEngine(target, drafter).generate(prompt, GREEDY, spec, StopRules(max_tokens=13))
    assert result.tokens == expected and len(result.tokens) == 13


def test_a_drafter_missing_part_of_the_protocol_is_refused_up_front(checkpoints):
    """The engine checks the Drafter protocol once, naming what is missing; DrafterBase supplies the
    defaults, so a drafter written against it needs only propose, commit and reset."""
    from verispec.drafters.base import DrafterBase, Proposal
    from verispec.errors import VerispecError
    from verispec.models.llama import load_checkpoint

    class Bare:
        def propose(self, context, num_drafts, sampling, generator):
            return Proposal(torch.tensor([context[-1]] * num_drafts), None)

        def commit(self, context):
            pass

        def reset(self):
            pass

    class Repeats(DrafterBase, Bare):
        pass

    target = load_checkpoint(checkpoints["llama"])
    with pytest.raises(VerispecError, match="missing propose_tree, bind, observe, reads"):
        SpecEngine(target, Bare())
    greedy, stop = SamplingParams(temperature=0), StopRules(max_tokens=12, ignore_eos=True)
    plain = SpecEngine(target).generate([1, 2, 3], greedy, SpecConfig(method="none"), stop).tokens
    assert SpecEngine(target, Repeats()).generate([1, 2, 3], greedy, SpecConfig(gamma=3), stop).tokens == plain
    with pytest.raises(VerispecError, match="drafts chains only"):
        SpecEngine(target, Repeats()).generate([1, 2, 3], greedy, SpecConfig(method="tree", tree="s2_k2_d4"), stop)
