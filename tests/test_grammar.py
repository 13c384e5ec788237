"""Structured outputs (verispec.grammar): the grammar's mask is one more sampling transform, exact under
speculation for every method.

Deterministic checks: the masks a round verifies with are the masks a fresh matcher gives along the same
tokens (chains, cut drafts, tree paths); greedy output under a grammar is token for token the same for
plain decoding and every drafter, alone or batched. Statistical checks: sampled output follows the
constrained target's exact distribution (the audit's teacher forcing under the grammar's masks), and
the same test fails an engine whose masks are off by one row.
"""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest
import torch

pytest.importorskip("llguidance")

from verispec.audit import goodness_of_fit, sample_continuations, sample_seeds, sequence_probabilities  # noqa: E402
from verispec.batch import BatchEngine, BatchRequest  # noqa: E402
from verispec.cli import main  # noqa: E402
from verispec.config import SamplingParams, SpecConfig, StopRules  # noqa: E402
from verispec.drafters import DraftModelDrafter  # noqa: E402
from verispec.drafters.eagle import EagleDrafter  # noqa: E402
from verispec.engine import SpecEngine  # noqa: E402
from verispec.grammar import GrammarCompiler, GrammarError, GrammarSpec  # noqa: E402
from verispec.loading import ModelPair, build_engine, eos_ids, load_pair  # noqa: E402
from verispec.models.eagle import EagleHead, for_inference  # noqa: E402

REGEX = r"[ab]{1,3}(-[0-9]{2}){1,2}"
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                            "maximum": 99},
                                           "tag": {"enum": ["x", "yy"]}},
          "required": ["ok", "n", "tag"], "additionalProperties": False}
GRAMMARS = {"regex": GrammarSpec("regex", REGEX), "json_schema": GrammarSpec.json_schema(SCHEMA),
            "json_object": GrammarSpec("json_object"),
            "lark": GrammarSpec("lark", 'start: "say " WORD "!"\nWORD: /[a-c]{2,4}/')}
SPECS = {"plain": SpecConfig(method="none"), "chain": SpecConfig(gamma=3), "ngram": SpecConfig(drafter="ngram"),
         "self": SpecConfig(drafter="early_exit", exit_layer=1), "tree": SpecConfig(method="tree", tree="s3_k2_d6"),
         "dynamic": SpecConfig(method="tree", tree="dynamic:8"),
         "perfect": SpecConfig(gamma=4), "perfect-tree": SpecConfig(method="tree", tree="s4_k2_d8"),
         "eagle": SpecConfig(drafter="eagle", gamma=3), "eagle-tree": SpecConfig(method="tree", drafter="eagle"),
         "eagle-dynamic": SpecConfig(method="tree", drafter="eagle", tree="dynamic:8")}


@pytest.fixture(scope="module")
def pair(byte_pair) -> ModelPair:
    return load_pair(*byte_pair, draft_weights="native")


@pytest.fixture(scope="module")
def compiler(pair) -> GrammarCompiler:
    return GrammarCompiler(pair.tokenizer, pair.target.config.vocab_size, eos_ids(pair.tokenizer, pair.target))


@pytest.fixture(scope="module")
def head(pair):
    """An untrained EAGLE head for the byte target, weights perturbed so its drafts are sometimes right."""
    torch.manual_seed(0)
    head = EagleHead.for_target(pair.target, pair.target.config.vocab_size)
    with torch.no_grad():
        for parameter in (*head.fc.parameters(), *head.body.model.layers.parameters()):
            parameter.add_(0.02 * torch.randn_like(parameter))
    return for_inference(head, False)


def engine_for(pair, method: str, head=None) -> SpecEngine:
    """``perfect`` drafts with the target itself: every draft is what the target would pick."""
    if method.startswith("perfect"):
        return SpecEngine(pair.target, DraftModelDrafter(pair.target))
    if method.startswith("eagle"):
        return SpecEngine(pair.target, EagleDrafter(head, pair.target.config.max_context))
    return build_engine(pair, SPECS[method])


def ids(pair, text: str) -> list[int]:
    return pair.tokenizer.encode(text, add_special_tokens=False)


def matches(spec: GrammarSpec, text: str) -> bool:
    if spec.kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    if spec.kind == "lark":
        return re.fullmatch(r"say [a-c]{2,4}!", text) is not None
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False
    if spec.kind == "json_object":
        return isinstance(value, dict)
    import jsonschema_rs

    return jsonschema_rs.is_valid(SCHEMA, value)


# ---- the matcher: masks, staging, rollback ------------------------------------------------------------


def test_the_mask_allows_exactly_what_the_regex_can_take_next(pair, compiler):
    guide = compiler.constraint(GrammarSpec("regex", "[ab][0-9]"))
    first = guide.mask().nonzero().flatten().tolist()
    assert sorted(first) == sorted(ids(pair, "a") + ids(pair, "b"))
    guide.advance(ids(pair, "b"))
    assert sorted(guide.mask().nonzero().flatten().tolist()) == sorted(ids(pair, "0123456789"))
    guide.advance(ids(pair, "7"))
    assert guide.mask().nonzero().flatten().tolist() == list(compiler.eos_ids)  # complete: EOS only
    with pytest.raises(GrammarError):
        compiler.constraint(GrammarSpec("regex", "[ab][0-9]")).advance(ids(pair, "c"))


def test_staged_drafts_roll_back_and_their_masks_are_a_fresh_matchers(pair, compiler):
    guide = compiler.constraint(GRAMMARS["regex"])
    guide.advance(ids(pair, "ab"))
    before = guide.mask().clone()
    drafts = ids(pair, "a-12-3")
    allowed, forced, masks = guide.round_masks(drafts)
    assert allowed == len(drafts) and forced == [] and masks.shape == (len(drafts) + 1, guide.vocab_size)
    reference, count = compiler.constraint(GRAMMARS["regex"]).path_masks(ids(pair, "ab") + drafts)
    assert count == len(drafts) + 2 and torch.equal(masks, reference[2:])
    guide.unstage()
    assert torch.equal(guide.mask(), before)


def test_a_proposal_is_cut_at_the_first_draft_the_grammar_forbids(pair, compiler):
    guide = compiler.constraint(GRAMMARS["regex"])
    drafts = ids(pair, "ba-1x-22")  # "x" cannot follow "ba-1"
    allowed, forced, masks = guide.round_masks(drafts, forced_limit=8)
    assert allowed == 4 and forced == [] and masks.shape[0] == 5  # nothing is forced after a cut
    assert not masks[4][drafts[4]] and masks[4][ids(pair, "5")[0]]
    guide.unstage()
    assert guide.staged == [] and torch.equal(guide.mask(), compiler.constraint(GRAMMARS["regex"]).mask())


def test_a_drafter_that_staged_other_tokens_is_restaged_from_the_committed_state(pair, compiler):
    guide = compiler.constraint(GRAMMARS["regex"])
    for token in ids(pair, "aa"):
        assert guide.stage(token)
    allowed, _, masks = guide.round_masks(ids(pair, "b-"))
    reference, _ = compiler.constraint(GRAMMARS["regex"]).path_masks(ids(pair, "b-"))
    assert allowed == 2 and torch.equal(masks, reference)


def test_tree_rows_get_the_mask_after_their_node_path(pair, compiler):
    guide = compiler.constraint(GRAMMARS["regex"])
    a, b, dash, one, x = (ids(pair, c)[0] for c in "ab-1x")
    tokens = [b, a, x, dash, b, one, dash]  # node 0 is the root (the last committed token)
    parents = [-1, 0, 0, 1, 1, 3, 4]  # paths: a, x, a-, ab, a-1, ab-
    rows = guide.tree_masks(parents, tokens)
    root, _ = compiler.constraint(GRAMMARS["regex"]).path_masks([])
    assert torch.equal(rows[0], root[0])
    for node, path in {1: [a], 3: [a, dash], 4: [a, b], 5: [a, dash, one], 6: [a, b, dash]}.items():
        expected, count = compiler.constraint(GRAMMARS["regex"]).path_masks(path)
        assert count == len(path) and torch.equal(rows[node], expected[-1]), node
    assert bool(rows[2].all())  # under a forbidden node: never used, allows everything


def test_past_the_end_only_eos_follows(pair, compiler):
    guide = compiler.constraint(GrammarSpec("regex", "ab"))
    guide.advance(ids(pair, "ab"))
    eos = list(compiler.eos_ids)
    for _ in range(3):  # EOS, then EOS again (what ignore_eos pads with)
        assert guide.mask().nonzero().flatten().tolist() == eos
        guide.advance(eos[:1])
    assert guide.stage(eos[0]) and guide.round_masks(eos[:1] * 3)[0] == 3


def test_tokens_the_grammar_forces_are_appended_as_free_drafts(pair, compiler):
    guide = compiler.constraint(GrammarSpec("regex", "ab(c|d)xyz"))
    allowed, forced, masks = guide.round_masks([], forced_limit=8)
    assert allowed == 0 and forced == ids(pair, "ab") and masks.shape[0] == 3
    reference, _ = compiler.constraint(GrammarSpec("regex", "ab(c|d)xyz")).path_masks(forced)
    assert torch.equal(masks, reference)
    guide.unstage()
    allowed, forced, _ = guide.round_masks(ids(pair, "abc"), forced_limit=2)
    assert allowed == 3 and forced == ids(pair, "xy")  # capped by the limit
    guide.unstage()
    assert guide.round_masks(ids(pair, "a"), forced_limit=0)[1] == []


def test_plain_decoding_verifies_forced_tokens_in_the_same_pass(pair, compiler):
    stop = StopRules(max_tokens=40, eos_ids=compiler.eos_ids)
    spec = GrammarSpec("regex", '[ab]-(sunday|monday)-[0-9]')
    result = engine_for(pair, "plain").generate(ids(pair, "Day: "), SamplingParams(
        temperature=0, guide=compiler.constraint(spec)), SPECS["plain"], stop)
    text = pair.tokenizer.decode(result.tokens, skip_special_tokens=True)
    assert re.fullmatch('[ab]-(sunday|monday)-[0-9]', text), text
    assert result.stats.accepted >= 4 and len(result.stats.rounds) < len(result.tokens)  # "unday" etc. for free


@pytest.mark.parametrize("spec, message", [
    (lambda: GrammarSpec("yaml", "x"), "grammar kind must be one of"),
    (lambda: GrammarSpec("regex", " "), "needs a non-empty source"),
    (lambda: GrammarSpec.json_schema("{not json"), "not valid JSON"),
    (lambda: GrammarSpec.json_schema("[1, 2]"), "must be a JSON object"),
])
def test_bad_grammar_specs_are_user_errors(spec, message):
    with pytest.raises(GrammarError, match=message):
        spec()


@pytest.mark.parametrize("spec", [GrammarSpec("regex", "[a-"), GrammarSpec("lark", "start: missing_rule"),
                                  GrammarSpec.json_schema({"type": "object", "properties": {"a": {"type": 5}}})])
def test_grammars_that_do_not_compile_are_one_line_user_errors(compiler, spec):
    with pytest.raises(GrammarError, match="does not compile") as caught:
        compiler.constraint(spec)
    assert "\n" not in str(caught.value)


# ---- greedy: every method gives plain decoding's constrained output ------------------------------------


@pytest.mark.parametrize("grammar", list(GRAMMARS))
def test_greedy_output_under_a_grammar_is_the_same_for_every_method(pair, compiler, head, grammar):
    spec_of = GRAMMARS[grammar]
    stop = StopRules(max_tokens=40, eos_ids=compiler.eos_ids)
    prompt = ids(pair, "Answer: ")
    outputs, drafted = {}, {}
    for method, spec in SPECS.items():
        sampling = SamplingParams(temperature=0, guide=compiler.constraint(spec_of))
        result = engine_for(pair, method, head).generate(prompt, sampling, spec, stop)
        outputs[method], drafted[method] = result.tokens, result.stats.drafted
        if result.finish_reason == "stop":
            assert matches(spec_of, pair.tokenizer.decode(result.tokens, skip_special_tokens=True)), method
    assert all(tokens == outputs["plain"] for tokens in outputs.values()), outputs
    assert all(drafted[method] > 0 for method in SPECS if method != "plain" and method != "ngram")


def test_batched_rows_under_different_grammars_decode_as_alone(pair, compiler):
    stop = StopRules(max_tokens=30, eos_ids=compiler.eos_ids)
    prompts = [ids(pair, text) for text in ("Q: ", "JSON: ", "free text ", "Lark: ", "again: ")]
    grammars = [GRAMMARS["regex"], GRAMMARS["json_schema"], None, GRAMMARS["lark"], GRAMMARS["json_object"]]
    for name, spec in (("chain", SpecConfig(gamma=3)), ("ngram", SpecConfig(drafter="ngram")),
                       ("plain", SpecConfig(method="none"))):
        engine = BatchEngine(pair.target, pair.draft, spec, max_batch=len(prompts))
        outputs: dict[str, list[int]] = {}
        for index, (prompt, grammar) in enumerate(zip(prompts, grammars)):
            guide = None if grammar is None else compiler.constraint(grammar)
            for event in engine.add(BatchRequest(str(index), prompt, SamplingParams(temperature=0, guide=guide), stop)):
                outputs.setdefault(event.request_id, []).extend(event.tokens)
        while engine.active:
            for event in engine.step():
                outputs.setdefault(event.request_id, []).extend(event.tokens)
        for index, (prompt, grammar) in enumerate(zip(prompts, grammars)):
            guide = None if grammar is None else compiler.constraint(grammar)
            alone = SpecEngine(pair.target).generate(prompt, SamplingParams(temperature=0, guide=guide),
                                                     SpecConfig(method="none"), stop).tokens
            assert outputs[str(index)] == alone, (name, index)


# ---- sampled: the constrained target's exact distribution ----------------------------------------------

AUDIT_REGEX = GrammarSpec("regex", r"[ab][abc0-2]{1,2}(x|yz)?")
AUDIT_TOKENS, AUDIT_SAMPLES = 4, 1500


def audit_fit(pair, compiler, engine, spec, sampling, samples=AUDIT_SAMPLES):
    sampling = replace(sampling, guide=compiler.constraint(AUDIT_REGEX))
    prompt = ids(pair, "> ")
    counts, drafted, accepted = sample_continuations(engine, prompt, sampling, spec, AUDIT_TOKENS,
                                                     sample_seeds(5, 0, samples))
    probs = sequence_probabilities(pair.target, prompt, list(counts), sampling)
    return goodness_of_fit(counts, probs), drafted, accepted


@pytest.mark.parametrize("method, sampling", [
    ("chain", SamplingParams(temperature=1.0)),
    ("tree", SamplingParams(temperature=0.8, top_k=8, top_p=0.95)),
    ("ngram", SamplingParams(temperature=1.0, min_p=0.05)),
    ("dynamic", SamplingParams(temperature=1.0)),
    ("eagle", SamplingParams(temperature=1.0, top_p=0.9)),
])
def test_sampled_output_follows_the_constrained_target_exactly(pair, compiler, head, method, sampling):
    spec = SPECS[method] if method != "tree" else replace(SPECS["tree"], sibling_mode="iid")
    samples = 400 if method == "dynamic" else 1000  # dynamic rounds cost the most here
    fit, drafted, accepted = audit_fit(pair, compiler, engine_for(pair, method, head), spec, sampling, samples)
    assert not fit.impossible and fit.p_value > 1e-3 and fit.tv < 2 * fit.noise_floor, fit
    assert fit.distinct > 5  # a test with something to test
    if method != "ngram":
        assert 0 < accepted < drafted  # rounds both accepted and rejected drafts


def test_the_audit_fails_a_drafter_that_reports_q_without_the_mask(pair, compiler, monkeypatch):
    """Drafts drawn under the grammar's mask but reported with the unmasked q (the classic "q of another
    distribution" bug): every token stays inside the grammar, only the distribution is wrong."""
    import verispec.drafters.draft_model as draft_model
    from verispec.sampling import draw_draft, logits_to_probs

    def unmasked_q(logits, params, generator):
        token, q = draw_draft(logits, params, generator)
        return token, None if q is None else logits_to_probs(logits, params)

    monkeypatch.setattr(draft_model, "draw_draft", unmasked_q)
    fit, _, _ = audit_fit(pair, compiler, engine_for(pair, "chain"), SPECS["chain"], SamplingParams(temperature=1.0),
                          samples=AUDIT_SAMPLES)
    assert not fit.impossible and fit.p_value < 1e-3, fit


def test_batched_sampling_follows_the_constrained_target_exactly(pair, compiler):
    sampling = SamplingParams(temperature=1.0)
    prompt = ids(pair, "> ")
    engine = BatchEngine(pair.target, pair.draft, SpecConfig(gamma=3), max_batch=6)
    counts: dict[tuple[int, ...], int] = {}
    seeds = sample_seeds(9, 0, 600)
    queue = [BatchRequest(str(i), prompt, replace(sampling, guide=compiler.constraint(AUDIT_REGEX)),
                          StopRules(max_tokens=AUDIT_TOKENS, ignore_eos=True), seed=seed)
             for i, seed in enumerate(seeds)]
    outputs: dict[str, list[int]] = {}
    while queue or engine.active:
        while queue and engine.has_capacity:
            for event in engine.add(queue.pop()):
                outputs.setdefault(event.request_id, []).extend(event.tokens)
        for event in engine.step():
            outputs.setdefault(event.request_id, []).extend(event.tokens)
    for tokens in outputs.values():
        counts[tuple(tokens)] = counts.get(tuple(tokens), 0) + 1
    reference = replace(sampling, guide=compiler.constraint(AUDIT_REGEX))
    fit = goodness_of_fit(counts, sequence_probabilities(pair.target, prompt, list(counts), reference))
    assert not fit.impossible and fit.p_value > 1e-3 and fit.tv < 2 * fit.noise_floor, fit


# ---- the CLI -------------------------------------------------------------------------------------------


def test_generate_with_a_regex_prints_matching_text(capsys, byte_pair):
    target, draft = byte_pair
    code = main(["generate", "Code: ", "--target", str(target), "--draft", str(draft), "--regex", REGEX,
                 "--max-tokens", "24", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and re.fullmatch(REGEX, out["text"]), out["text"]


def test_generate_with_a_json_schema_file(capsys, byte_pair, tmp_path):
    target, draft = byte_pair
    (tmp_path / "schema.json").write_text(json.dumps(SCHEMA))
    code = main(["generate", "JSON: ", "--target", str(target), "--draft", str(draft), "--json-schema",
                 str(tmp_path / "schema.json"), "--max-tokens", "40", "--temperature", "0.7", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["stats"]["finish_reason"] == "stop" and matches(GRAMMARS["json_schema"], out["text"])


@pytest.mark.parametrize("args, message", [
    (["--json-schema", "/no/such/schema.json"], "cannot read --json-schema"),
    (["--regex", "[a-"], "does not compile"),
])
def test_generate_grammar_errors_are_one_line_exit_2(capsys, byte_pair, args, message):
    target, draft = byte_pair
    code = main(["generate", "x", "--target", str(target), "--draft", str(draft), *args])
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.count("\n") == 1
