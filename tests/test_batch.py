"""Batched engine: every sequence in a continuously batched run decodes exactly as it would alone."""

from __future__ import annotations

import json
import random

import pytest

from verispec.adaptive import AdaptiveGamma, GammaPolicyBase, HFHeuristicGamma
from verispec.batch import BatchEngine, BatchRequest
from verispec.config import SamplingParams, SpecConfig, StopRules
from verispec.drafters import DraftModelDrafter, NgramDrafter
from verispec.engine import SpecEngine
from verispec.models.llama import load_checkpoint

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def models(checkpoints):
    return load_checkpoint(checkpoints["llama"]), load_checkpoint(checkpoints["draft"])


def requests(count, sampling, seed=0):
    rng = random.Random(seed)
    return [BatchRequest(str(i), [rng.randrange(64) for _ in range(rng.randrange(2, 14))], sampling,
                         StopRules(max_tokens=4 + i % 9), seed=i) for i in range(count)]


def run_batched(engine, queue):
    """Admit requests as rows free up (continuous batching); collect each request's tokens."""
    queue, out, finished = list(queue), {}, {}
    while queue or engine.active:
        while queue and engine.has_capacity:
            for event in engine.add(queue.pop(0)):
                out.setdefault(event.request_id, []).extend(event.tokens)
                if event.finished:
                    finished[event.request_id] = event
        for event in engine.step():
            out.setdefault(event.request_id, []).extend(event.tokens)
            if event.finished:
                finished[event.request_id] = event
    return out, finished


def alone(target, drafter, request, spec):
    return SpecEngine(target, drafter).generate(request.prompt_ids, request.sampling, spec, request.stop,
                                                seed=request.seed).tokens


@pytest.mark.parametrize("spec", [SpecConfig(method="none"), SpecConfig(gamma=1), SpecConfig(gamma=4),
                                  SpecConfig(gamma=3, drafter="ngram"), SpecConfig(gamma=3, draft_vocab=20)],
                         ids=["off", "g1", "g4", "ngram", "g3-vocab20"])
@pytest.mark.parametrize("sampling", [GREEDY, SamplingParams(temperature=1.0, top_p=0.9)], ids=["greedy", "sampled"])
def test_batched_equals_single_sequence(models, spec, sampling):
    """Fixed gamma: each row uses its own generator in the same order as SpecEngine, so even sampled
    outputs match token for token; greedy matches plain decoding."""
    target, draft = models
    queue = requests(14, sampling)
    engine = BatchEngine(target, draft, spec, max_batch=5)
    out, finished = run_batched(engine, queue)
    assert set(finished) == {r.request_id for r in queue}  # nobody lost
    drafter = NgramDrafter() if spec.drafter == "ngram" else DraftModelDrafter(draft, vocab_limit=spec.draft_vocab)
    for request in queue:
        assert out[request.request_id] == alone(target, drafter, request, spec), request.request_id
        assert finished[request.request_id].stats.generated_tokens == len(out[request.request_id])


@pytest.mark.parametrize("rows", [1, 5, 17, 65])
def test_greedy_outputs_do_not_depend_on_the_batch(checkpoints, models, rows):
    """Greedy answers are plain decoding's at 1, 5, 17 and 65 rows with an int8 draft (as shipped), though
    passes over 16 rows leave the kernel for torch's GEMM (logits may differ in the last bits) and the
    draft's int8 rows serve passes of up to 4 rows only."""
    from verispec import kernels

    target, _ = models
    draft = load_checkpoint(checkpoints["draft"])
    if kernels.library() is not None:
        assert kernels.quantize(draft) > 0
    queue = requests(rows, GREEDY, seed=7)
    out, _ = run_batched(BatchEngine(target, draft, SpecConfig(gamma=4), max_batch=rows), queue)
    for request in queue:
        assert out[request.request_id] == alone(target, None, request, SpecConfig(method="none")), request.request_id


def test_a_vocabulary_limited_draft_keeps_greedy_outputs(models):
    target, draft = models
    queue = requests(6, GREEDY)
    out, _ = run_batched(BatchEngine(target, draft, SpecConfig(gamma=3, draft_vocab=8), max_batch=4), queue)
    for request in queue:  # greedy speculation commits exactly plain decoding's tokens
        assert out[request.request_id] == alone(target, None, request, SpecConfig(method="none"))


@pytest.mark.parametrize("policy", [AdaptiveGamma(max_gamma=4, explore_every=5), HFHeuristicGamma()])
def test_adaptive_gamma_keeps_greedy_outputs(models, policy):
    target, draft = models
    queue = requests(12, GREEDY, seed=3)
    out, _ = run_batched(BatchEngine(target, draft, SpecConfig(gamma=4), max_batch=4, gamma_policy=policy), queue)
    for request in queue:
        assert out[request.request_id] == alone(target, None, request, SpecConfig(method="none"))


class Scripted(GammaPolicyBase):
    """A gamma policy that plays a fixed list of gammas, then repeats its last."""

    def __init__(self, gammas):
        self.gammas, self.round = gammas, 0

    def choose(self, batch_size, request=None):
        self.round += 1
        return self.gammas[min(self.round, len(self.gammas)) - 1]


@pytest.mark.parametrize("sampling", [GREEDY, SamplingParams(temperature=1.0, top_k=20)], ids=["greedy", "sampled"])
def test_long_prompts_caught_up_alone_decode_as_alone(models, sampling):
    """Prompts longer than CATCH_UP_ALONE reach the draft row by row; outputs still match SpecEngine."""
    target, draft = models
    rng = random.Random(5)
    queue = [BatchRequest(str(i), [rng.randrange(64) for _ in range(rng.randrange(17, 40))], sampling,
                          StopRules(max_tokens=6 + i), seed=i) for i in range(6)]
    out, _ = run_batched(BatchEngine(target, draft, SpecConfig(gamma=3), max_batch=3), queue)
    for request in queue:
        assert out[request.request_id] == alone(target, DraftModelDrafter(draft), request, SpecConfig(gamma=3))


def test_rounds_at_gamma_zero_never_run_the_draft(models, monkeypatch):
    """Held at gamma 0 the batch costs what plain decoding costs: the draft reads nothing. When
    speculation resumes, the draft catches up on the whole backlog and greedy outputs stay plain."""
    target, draft = models
    calls = []
    original = draft.forward
    monkeypatch.setattr(draft, "forward", lambda *a, **k: calls.append(1) or original(*a, **k))
    monkeypatch.setattr(draft, "run_layers", lambda *a, **k: calls.append(1) or type(draft).run_layers(draft, *a, **k))
    rng = random.Random(6)
    queue = [BatchRequest(str(i), [rng.randrange(64) for _ in range(rng.randrange(3, 30))], GREEDY,
                          StopRules(max_tokens=40)) for i in range(4)]
    engine = BatchEngine(target, draft, SpecConfig(gamma=4), max_batch=4, gamma_policy=Scripted([0] * 25 + [3]))
    out = {}
    for request in queue:
        out[request.request_id] = engine.add(request)[0].tokens
    for _ in range(25):
        for event in engine.step():
            out[event.request_id] += event.tokens
    assert calls == [] and engine.active == 4
    while engine.active:
        for event in engine.step():
            out[event.request_id] += event.tokens
    assert calls  # speculation resumed
    for request in queue:
        assert out[request.request_id] == alone(target, None, request, SpecConfig(method="none"))


def test_abort_frees_the_row_and_others_continue(models):
    target, draft = models
    engine = BatchEngine(target, draft, SpecConfig(gamma=2), max_batch=2)
    queue = [BatchRequest(n, [1, 2, 3], GREEDY, StopRules(max_tokens=30)) for n in ("a", "b")]
    for request in queue:
        engine.add(request)
    engine.step()
    event = engine.abort("a")
    assert event.finish_reason == "abort" and engine.active == 1 and engine.has_capacity
    out, _ = run_batched(engine, [])
    assert len(out["b"]) > 0


def test_finished_requests_report_their_output_lengths_and_aborted_ones_do_not(models):
    """The adaptive policy prices prompt reads per output token from ``finished`` reports."""
    class Finishing(Scripted):
        def __init__(self):
            super().__init__([2])
            self.outputs = []

        def finished(self, output_tokens):
            self.outputs.append(output_tokens)

    target, draft = models
    policy = Finishing()
    engine = BatchEngine(target, draft, SpecConfig(gamma=2), max_batch=4, gamma_policy=policy)
    queue = requests(6, GREEDY)
    engine.add(BatchRequest("gone", [1, 2, 3], GREEDY, StopRules(max_tokens=30)))
    engine.step()
    engine.abort("gone")
    out, finished = run_batched(engine, queue)
    assert sorted(policy.outputs) == sorted(len(out[r.request_id]) for r in queue)
    assert all(finished[r.request_id].finish_reason != "abort" for r in queue)


def test_batch_engine_charges_prompt_reading_and_drops_gamma_zero_backlog(models):
    """A new request's prompt read by the draft is charged to speculation; the backlog after rounds at
    gamma 0 is left out of both the round times and the charge."""

    class Recording(Scripted):
        def __init__(self, gammas):
            super().__init__(gammas)
            self.charged, self.observed = [], []

        def charge(self, batch_size, seconds, prompts=1):
            self.charged.append((seconds, prompts))

        def observe(self, batch_size, gamma, seconds, accepted, drafted):
            self.observed.append((gamma, seconds))

    target, draft = models
    policy = Recording([2] + [0] * 20 + [2])
    engine = BatchEngine(target, draft, SpecConfig(gamma=2), max_batch=2, gamma_policy=policy)
    prompt = [3 + i % 20 for i in range(40)]  # >= CATCH_UP_ALONE: read alone
    engine.add(BatchRequest("a", prompt, GREEDY, StopRules(max_tokens=60, ignore_eos=True)))
    while engine.active:
        engine.step()
    # Round 1 read the prompt (charged once); rounds 2-21 ran at gamma 0; round 22 caught up on 20+
    # tokens alone (neither charged nor observed).
    assert len(policy.charged) == 1 and policy.charged[0][0] > 0 and policy.charged[0][1] == 1
    assert [g for g, _ in policy.observed][:23] == [2] + [0] * 20 + [2, 2]


def test_batch_engine_asks_before_reading_a_backlog(models):
    """The engine prices what its draft must read before a round: a policy that refuses every switch
    keeps the draft from ever running, and outputs stay plain decoding's."""
    target, draft = models

    class Refusing(Scripted):
        def __init__(self):
            super().__init__([3])
            self.asked = []

        def afford(self, batch_size, gamma, backlog):
            self.asked.append(backlog)
            return 0

    policy = Refusing()
    engine = BatchEngine(target, draft, SpecConfig(gamma=3), max_batch=4, gamma_policy=policy)
    queue = requests(6, GREEDY, seed=5)
    calls = []
    original = draft.forward
    draft.forward = lambda *a, **k: calls.append(1) or original(*a, **k)
    try:
        out, _ = run_batched(engine, queue)
    finally:
        del draft.forward
    assert calls == [] and policy.asked
    first = policy.asked[0]
    assert first.tokens == sum(len(r.prompt_ids) for r in queue[:4])  # prompt + first token, but the last
    assert first.remaining == sum(r.stop.max_tokens - 1 for r in queue[:4])
    for request in queue:
        assert out[request.request_id] == alone(target, None, request, SpecConfig(method="none"))


def test_a_traced_policy_decides_as_untraced_and_logs_every_round(models, tmp_path):
    """``PolicyTrace`` (serve --trace-rounds) passes every call through, so the traced run decodes the
    same tokens with the same gammas, and writes one line per round that matches what the round did."""
    from verispec.policy_trace import PolicyTrace

    target, draft = models
    queue = requests(10, GREEDY)
    plain, _ = run_batched(BatchEngine(target, draft, SpecConfig(gamma=4), max_batch=4,
                                       gamma_policy=HFHeuristicGamma(initial=2, max_gamma=4)), queue)
    path = tmp_path / "rounds.jsonl"
    traced_policy = PolicyTrace(HFHeuristicGamma(initial=2, max_gamma=4), path)
    traced, _ = run_batched(BatchEngine(target, draft, SpecConfig(gamma=4), max_batch=4,
                                        gamma_policy=traced_policy), queue)
    traced_policy.close()
    assert traced == plain
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines[0]["policy"] == "HFHeuristicGamma" and "start" in lines[0]
    rounds = lines[1:]
    assert len(rounds) >= len(queue)
    for line in rounds:
        assert 1 <= line["batch"] <= 4 and line["seconds"] > 0
        assert line["gamma"] <= line["chosen"] <= 4
        assert line["drafted"] == 0 or line["gamma"] > 0  # rows on their last token draft nothing
        assert 0 <= line["accepted"] <= line["gamma"] * line["drafted"]
    assert len({line["gamma"] for line in rounds}) > 1  # the rule moved, and the trace saw it
    # An adaptive policy's decisions carry the load it chose for, and its reads are priced through the trace.
    adaptive = PolicyTrace(AdaptiveGamma(max_gamma=3), tmp_path / "adaptive.jsonl")
    run_batched(BatchEngine(target, draft, SpecConfig(gamma=3), max_batch=4, gamma_policy=adaptive), queue)
    adaptive.close()
    rounds = [json.loads(line) for line in (tmp_path / "adaptive.jsonl").read_text().splitlines()[1:]]
    assert all(line["load"] >= line["batch"] for line in rounds)
    assert any("backlog" in line for line in rounds) and adaptive.counts.rounds > 0
