"""The batched engine with a drafter per row: trees (static and dynamic, every sibling mode), n-gram,
self-speculation and an EAGLE head decode in a continuous batch exactly as ``SpecEngine`` decodes each
request alone (whose sampled outputs are checked against the target's distribution in
test_engine_statistical.py and test_engine_tree.py), and every method runs up to the context limit."""

from __future__ import annotations

import random

import pytest

from test_batch import GREEDY, alone, models, requests, run_batched  # noqa: F401 (fixture)
from test_eagle import frozen_head
from verispec.adaptive import FixedGamma
from verispec.batch import BatchEngine, BatchRequest
from verispec.config import SamplingParams, SpecConfig, StopRules
from verispec.drafters import DraftModelDrafter, EarlyExitDrafter, NgramDrafter
from verispec.drafters.eagle import EagleDrafter
from verispec.errors import VerispecError

SAMPLED = SamplingParams(temperature=1.0, top_p=0.9)
SPECS = {
    "tree": SpecConfig(method="tree", tree="s3_k2_d6"),
    "tree-wide": SpecConfig(method="tree", tree="s2_k3_d7"),
    "tree-iid": SpecConfig(method="tree", tree="s3_k2_d6", sibling_mode="iid"),
    "tree-wor": SpecConfig(method="tree", tree="s3_k2_d6", sibling_mode="without_replacement"),
    "ngram-tree": SpecConfig(method="tree", tree="s3_k2_d6", drafter="ngram"),
    "ngram": SpecConfig(gamma=3, drafter="ngram"),
    "self": SpecConfig(gamma=3, drafter="early_exit", exit_layer=1),
    "eagle": SpecConfig(gamma=3, drafter="eagle"),
    "eagle-tree": SpecConfig(method="tree", tree="s3_k2_d6", drafter="eagle"),
}


@pytest.fixture(scope="module")
def head(models):  # noqa: F811
    return frozen_head(models[0], models[0].config.vocab_size)


def drafter_for(spec, target, draft, head):
    return {"ngram": lambda: NgramDrafter(spec.ngram_max, spec.ngram_min),
            "early_exit": lambda: EarlyExitDrafter(target, spec.exit_layer),
            "eagle": lambda: EagleDrafter(head, target.config.max_context),
            "model": lambda: DraftModelDrafter(draft)}[spec.drafter]()


@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_batched_rows_decode_as_alone(models, head, name, sampling):  # noqa: F811
    """Each row's drafter and generator are its own and run in SpecEngine's order, so even sampled
    outputs match the request decoded alone, token for token; greedy ones are plain decoding's."""
    target, draft = models
    spec = SPECS[name]
    queue = requests(11, sampling, seed=2)
    out, finished = run_batched(BatchEngine(target, draft, spec, max_batch=4, eagle=head), queue)
    assert set(finished) == {r.request_id for r in queue}
    for request in queue:
        expected = alone(target, drafter_for(spec, target, draft, head), request, spec)
        assert out[request.request_id] == expected, request.request_id
        if sampling is GREEDY:
            assert expected == alone(target, None, request, SpecConfig(method="none"))
    if spec.method == "tree":  # trees were drafted and verified in the batch (not only chain fallbacks)
        assert max(r.tree_nodes for e in finished.values() for r in e.stats.rounds) == spec.max_drafts


def test_dynamic_trees_in_a_batch_keep_greedy_outputs(models):  # noqa: F811
    target, draft = models
    queue = requests(9, GREEDY, seed=4)
    out, _ = run_batched(BatchEngine(target, draft, SpecConfig(method="tree", tree="dynamic:8"), max_batch=3), queue)
    for request in queue:
        assert out[request.request_id] == alone(target, None, request, SpecConfig(method="none"))


@pytest.mark.parametrize("name", ["chain", "tree", "ngram-tree", "self", "eagle-tree", "dynamic"])
def test_every_method_runs_to_the_context_limit(models, head, name):  # noqa: F811
    """Requests whose prompt + max_tokens is the whole context share a batch with short ones: proposals
    are capped by the tokens left and the cache room, and nothing overflows (greedy stays plain)."""
    target, draft = models
    spec = {"chain": SpecConfig(gamma=4), "dynamic": SpecConfig(method="tree", tree="dynamic:8")}.get(name) \
        or SPECS[name]
    max_len, rng = 48, random.Random(6)
    queue = []
    for index in range(6):
        prompt = [rng.randrange(64) for _ in range(rng.randrange(20, 40))]
        budget = max_len - len(prompt) if index % 2 == 0 else 5  # every other request fills the context
        queue.append(BatchRequest(str(index), prompt, GREEDY, StopRules(max_tokens=budget, eos_ids=())))
    out, finished = run_batched(BatchEngine(target, draft, spec, max_batch=4, max_len=max_len, eagle=head), queue)
    for request in queue:
        assert len(out[request.request_id]) == request.stop.max_tokens
        assert out[request.request_id] == alone(target, None, request, SpecConfig(method="none"))


@pytest.mark.parametrize("name", ["tree", "self", "dynamic"])
def test_single_requests_run_to_the_model_context(models, name):  # noqa: F811
    """SpecEngine at the model's own context limit: trees shrink to chains, nothing overflows."""
    from verispec.engine import SpecEngine

    target, draft = models
    spec = {"dynamic": SpecConfig(method="tree", tree="dynamic:8")}.get(name) or SPECS[name]
    prompt = [random.Random(8).randrange(64) for _ in range(target.config.max_context - 9)]
    stop = StopRules(max_tokens=9, eos_ids=())
    engine = SpecEngine(target, drafter_for(spec, target, draft, None))
    tokens = engine.generate(prompt, GREEDY, spec, stop).tokens
    assert tokens == SpecEngine(target, None).generate(prompt, GREEDY, SpecConfig(method="none"), stop).tokens
    assert len(tokens) == 9


def test_a_gamma_policy_with_trees_is_refused(models):  # noqa: F811
    from verispec.adaptive import AdaptiveGamma

    target, draft = models
    with pytest.raises(VerispecError, match="gamma policy"):
        BatchEngine(target, draft, SpecConfig(method="tree"), gamma_policy=AdaptiveGamma(max_gamma=4))


def test_pooled_drafters_serve_one_request_after_another(models):  # noqa: F811
    """A finished row's drafter is reset and lent to the next request, not rebuilt."""
    target, draft = models
    engine = BatchEngine(target, draft, SPECS["tree"], max_batch=2)
    out, _ = run_batched(engine, requests(7, GREEDY, seed=9))
    assert len(out) == 7 and not engine.rows
    assert 1 <= len(engine.own.free) <= 2  # the one built at start-up and at most one more per row


def test_tree_rounds_are_cut_to_the_tokens_left(models):  # noqa: F811
    """With 3 tokens to generate (one from the prefill), no round verifies a node deeper than the
    tokens left minus one: s3_k2_d6 (depth 3) is cut to depth 1, its 2 first-level nodes."""
    target, draft = models
    queue = [BatchRequest(str(i), [5 + i, 9, 3], GREEDY, StopRules(max_tokens=3, eos_ids=())) for i in range(3)]
    _, finished = run_batched(BatchEngine(target, draft, SPECS["tree"], max_batch=3), queue)
    rounds = [r for event in finished.values() for r in event.stats.rounds]
    assert rounds and all(r.drafted <= 1 and r.tree_nodes <= 2 for r in rounds)


@pytest.mark.parametrize("rows", [5, 17])
def test_tree_rows_keep_greedy_outputs_in_wide_batches(models, rows):  # noqa: F811
    """17 rows of 6-node trees make a 102-row verification pass (past the few-row kernel, into torch's
    GEMM): logits may differ from a row's own pass in the last bits, greedy tokens do not."""
    target, draft = models
    queue = requests(rows, GREEDY, seed=11)
    out, _ = run_batched(BatchEngine(target, draft, SPECS["tree"], max_batch=rows), queue)
    for request in queue:
        assert out[request.request_id] == alone(target, None, request, SpecConfig(method="none"))


class _Gate(FixedGamma):
    """A fixed gamma 2 that drafts only on rounds ``allow`` lists, recording each ``afford`` asked."""

    def __init__(self, allow: set[int]):
        super().__init__(2)
        self.allow, self.asked = allow, []

    def afford(self, batch_size, gamma, backlog):
        self.asked.append(backlog)
        return gamma if len(self.asked) in self.allow else 0


@pytest.mark.parametrize("kind", ["model", "eagle"])
def test_rows_own_drafters_ask_the_policy_to_afford_their_backlog(models, head, kind):  # noqa: F811
    """A lone request's drafter (what ``verispec generate`` runs) tells the policy what it would read
    before drafting; a declined round drafts nothing, and the backlog grows by what it committed."""
    target, draft = models
    policy = _Gate(allow={1, 5})
    make = (lambda: DraftModelDrafter(draft)) if kind == "model" else (lambda: EagleDrafter(head, 256))
    engine = BatchEngine(target, None, SpecConfig(gamma=2), max_batch=1, gamma_policy=policy, make_drafter=make)
    request = BatchRequest("r", [5, 6, 7, 8, 9, 10], GREEDY, StopRules(max_tokens=24, ignore_eos=True))
    engine.add(request)
    drafted, unread = [], []
    while engine.active:
        row = engine.rows[0]
        unread.append(row.drafter.unread(row.context))
        events = engine.step()
        drafted.append(row.stats.drafted)
    asked = [backlog.tokens for backlog in policy.asked]
    assert asked == unread[:len(asked)]
    assert asked[0] == (6 if kind == "model" else 5)  # the prompt and the prefill's token but the last (EAGLE: pairs)
    assert [asked[i + 1] - asked[i] for i in (1, 2, 3)] == [1, 1, 1]  # declined: each commits one token unread
    assert drafted[0] == 2 and drafted[1] == drafted[2] == drafted[3] == 2  # rounds 2-4 declined: no drafts
    assert drafted[4] > 2  # round 5 allowed: it read its backlog and drafted
    assert events and events[-1].finished
