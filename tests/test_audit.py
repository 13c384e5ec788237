"""verispec audit: exact sequence probabilities, every correct method passes, known-broken verifiers FAIL
(the statistics themselves: test_audit_stats.py).

The pair: a random 4-token target (2 layers) and a different random draft (1 layer), prompt
[1, 2, 3, 0, 2], n = 3 tokens (the first comes from prefill, so n = 3 is the shortest continuation whose
second token goes through a verifier). Each broken variant FAILS (alpha 1e-3) at the sample size below
for each of the audit seeds 0-7 tried in development, while the correct code passes at the same N and
setting (seeds 0-3 tried):

    variant                                                setting                     FAILS at N
    (a) chain: resample from p after a rejection           T 1, gamma 2                1200 (p <= 1e-7)
    (b) draft samples with top-p, reports q without it     T 2, top-p 0.5, gamma 2      800 (p <= 4e-7)
    (c) iid tree verifier skips duplicate siblings         T 0.7, tree s2_k4_d9 iid     600 (p <= 4e-5)

At 800 samples (a) fails for 7 of 8 seeds, at 600 (b) for 7 of 8: below these sizes the bugs are
visible only some of the time. Correct methods run at CORRECT_SAMPLES to keep CI fast. On this pair the
batched engine (what the CLI samples with) draws, seed for seed, the sequences SpecEngine draws, so each
broken variant is planted in both engines and FAILS through both.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import verispec.batch.draft as batch_draft_module
import verispec.batch.engine as batch_engine_module
import verispec.drafters.draft_model as draft_model_module
import verispec.engine as engine_module
from broken_verifiers import resample_from_target_after_rejection
from verispec.audit import (AuditConfig, SharedPrefill, audit_engine, run_audit, sample_continuations, sample_seeds,
                            sequence_probabilities)
from verispec.batch import BatchEngine
from verispec.cli import main
from verispec.config import SamplingParams, SpecConfig
from verispec.drafters import DraftModelDrafter, EarlyExitDrafter, NgramDrafter
from verispec.engine import SpecEngine
from verispec.engine_factory import ModelPair
from verispec.errors import VerispecError
from verispec.models.llama import load_checkpoint
from verispec.sampling import draw_draft, logits_to_probs, sample, sample_batch
from verispec.testing import make_byte_tokenizer, make_checkpoint
from verispec.verify.chain import ChainResult
from verispec.verify.tree import TreeResult, verify_tree

VOCAB, TOKENS = 4, 3
PROMPT = [1, 2, 3, 0, 2]
CORRECT_SAMPLES = 200


@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("audit")
    target = make_checkpoint(root / "target", VOCAB, hidden=32, layers=2, seed=40, via_transformers=False)
    draft = make_checkpoint(root / "draft", VOCAB, hidden=16, layers=1, heads=2, kv_heads=1, seed=41,
                            via_transformers=False)
    for path in (target, draft):
        make_byte_tokenizer(path)  # the CLI loads a tokenizer; prompts are passed as --prompt-ids
    return target, draft


@pytest.fixture(scope="module")
def pair(pair_dirs):
    return tuple(load_checkpoint(path) for path in pair_dirs)


def audit(engine, sampling, spec, samples, seed=0, tokens=TOKENS):
    return run_audit(engine, [PROMPT], sampling, spec, AuditConfig(tokens=tokens, samples=samples, seed=seed))


# ---- exact probabilities -----------------------------------------------------------------------------


def test_sequence_probabilities_are_exact_and_sum_to_one(pair, monkeypatch):
    target, _ = pair
    sampling = SamplingParams(temperature=0.8, top_k=3, top_p=0.9, min_p=0.1)
    sequences = [(a, b, c) for a in range(VOCAB) for b in range(VOCAB) for c in range(VOCAB)]
    batched = sequence_probabilities(target, PROMPT, sequences, sampling)
    assert sum(batched.values()) == pytest.approx(1.0, abs=1e-5)
    monkeypatch.setattr("verispec.audit.LOGITS_PER_FORWARD", 1)  # one row per forward
    assert sequence_probabilities(target, PROMPT, sequences, sampling) == pytest.approx(batched, abs=1e-6)
    seq = (2, 1, 3)  # one sequence by hand, position by position
    with torch.no_grad():
        manual = math.prod(float(logits_to_probs(target.train_forward(torch.tensor([PROMPT + list(seq[:i])]))[0][0, -1],
                                                 sampling)[seq[i]]) for i in range(3))
    assert batched[seq] == pytest.approx(manual, abs=1e-6)


# ---- correct methods pass ----------------------------------------------------------------------------

T1 = SamplingParams(temperature=1.0)
FILTERED = SamplingParams(temperature=0.8, top_k=3, top_p=0.9, min_p=0.1)
CORRECT = {
    "chain-t1": ("model", T1, SpecConfig(gamma=2)),
    "chain-t2-p0.5": ("model", SamplingParams(temperature=2.0, top_p=0.5), SpecConfig(gamma=2)),
    "chain-filtered": ("model", FILTERED, SpecConfig(gamma=4)),
    "tree-iid": ("model", SamplingParams(temperature=0.7), SpecConfig(method="tree", tree="s2_k4_d9", sibling_mode="iid")),
    "tree-without-replacement": ("model", T1, SpecConfig(method="tree", tree="s2_k3_d7", sibling_mode="without_replacement")),
    "tree-deterministic": ("model", FILTERED, SpecConfig(method="tree", tree="s2_k2_d5")),
    "self": ("self", SamplingParams(temperature=1.0, top_p=0.9), SpecConfig(gamma=2, drafter="early_exit", exit_layer=1)),
    "ngram-chain": ("ngram", T1, SpecConfig(gamma=2, drafter="ngram")),
    "ngram-tree": ("ngram", SamplingParams(temperature=0.9, min_p=0.1), SpecConfig(method="tree", tree="s2_k2_d4", drafter="ngram")),
}


def make_engine(pair, drafter: str) -> SpecEngine:
    target, draft = pair
    drafters = {"model": lambda: DraftModelDrafter(draft), "self": lambda: EarlyExitDrafter(target, 1),
                "ngram": lambda: NgramDrafter()}
    return SpecEngine(target, drafters[drafter]())


def make_batched(pair, spec: SpecConfig, rows: int = 8) -> BatchEngine:
    """The CLI's batched engine for ``spec`` over the pair (``spec`` names the drafter)."""
    target, draft = pair
    return audit_engine(ModelPair(target, draft, None, Path("target"), Path("draft")), spec, rows,
                        len(PROMPT) + TOKENS)


@pytest.mark.parametrize("name", list(CORRECT))
def test_correct_method_passes(pair, name):
    drafter, sampling, spec = CORRECT[name]
    report = audit(make_engine(pair, drafter), sampling, spec, CORRECT_SAMPLES)
    item = report.prompts[0]
    assert item.drafted > 0 and not report.notes, "the verifier must actually have been exercised"
    assert report.verdict == "pass", (report.p_value, report.tv, report.noise_floor)
    assert report.tv < 2 * report.noise_floor


def test_greedy_passes_trivially(pair):
    report = audit(make_engine(pair, "model"), SamplingParams(temperature=0.0), SpecConfig(gamma=2), 50)
    assert report.passed and report.prompts[0].fit.distinct == 1 and report.tv == pytest.approx(0, abs=1e-6)


# ---- the batched engine ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CORRECT))
def test_batched_audit_draws_the_sequential_audits_sequences(pair, name):
    """Seed for seed, 8 rows refilled as requests finish draw what SpecEngine draws one at a time: the same
    counts, draft positions verified and accepted, hence the same report."""
    drafter, sampling, spec = CORRECT[name]
    seeds = sample_seeds(3, 0, 120)
    batched = make_batched(pair, spec)
    assert isinstance(batched, BatchEngine) and isinstance(batched.target, SharedPrefill)
    counts, drafted, accepted = sample_continuations(batched, PROMPT, sampling, spec, TOKENS, seeds)
    sequential = make_engine(pair, drafter)
    assert (counts, drafted, accepted) == sample_continuations(sequential, PROMPT, sampling, spec, TOKENS, seeds)
    assert sum(counts.values()) == 120 and len(counts) > 5 and 0 < accepted < drafted
    report = audit(batched, sampling, spec, 120, seed=3)
    assert report.passed and report.as_dict() == audit(sequential, sampling, spec, 120, seed=3).as_dict()


def test_shared_prefill_replays_the_targets_own_prefill(pair, monkeypatch):
    target, _ = pair
    prompt, width = torch.tensor([PROMPT]), len(PROMPT)
    caches = [target.new_cache(2, 16).row_view(1) for _ in range(3)]  # one row of a batch cache, as add fills
    own = target.forward(prompt, caches[0], last_only=True)
    passes = []
    forward = target.forward
    monkeypatch.setattr(target, "forward", lambda *args, **kwargs: passes.append(1) or forward(*args, **kwargs))
    shared = SharedPrefill(target)
    first, replayed = (shared.forward(prompt, cache, last_only=True) for cache in caches[1:])
    assert len(passes) == 1 and torch.equal(first, own) and torch.equal(replayed, own) and replayed is not first
    for cache in caches[1:]:
        assert torch.equal(cache.keys[:, :, :, :width], caches[0].keys[:, :, :, :width])
        assert torch.equal(cache.values[:, :, :, :width], caches[0].values[:, :, :, :width])
    shared.forward(prompt, target.new_cache(2, 16), last_only=True)  # anything else runs the target
    assert len(passes) == 2 and shared.config is target.config


def test_every_pair_audits_in_the_batched_engine_but_rows_1_runs_spec_engine(pair):
    from verispec.drafters.cross_vocab import CrossVocabDrafter

    target, draft = pair
    spec = SpecConfig(gamma=2)
    assert isinstance(audit_engine(ModelPair(target, draft, None, Path("t"), Path("d")), spec, 1), SpecEngine)
    bridged = ModelPair(target, draft, None, Path("t"), Path("d"), bridge=object())  # a draft with its own tokenizer
    engine = audit_engine(bridged, spec, 8, 10)
    assert isinstance(engine, BatchEngine) and engine.draft is None  # drafted per row, through the bridge
    assert isinstance(engine.own.free[0], CrossVocabDrafter)
    assert isinstance(audit_engine(bridged, SpecConfig(gamma=2, drafter="ngram"), 8, 10), BatchEngine)


# ---- known-broken verifiers fail ---------------------------------------------------------------------


def report_q_without_top_p(monkeypatch) -> None:
    """(b) Known-wrong: the draft model samples from its top-p filtered q but hands the verifier its q
    before top-p (top-p reached the target's p and the draft's sampler, not the reported q)."""

    def draw_with_top_p_report_without(logits, sampling, generator):
        token, _ = draw_draft(logits, sampling, generator)
        return token, logits_to_probs(logits, replace(sampling, top_p=1.0))

    monkeypatch.setattr(draft_model_module, "draw_draft", draw_with_top_p_report_without)
    monkeypatch.setattr(batch_draft_module, "draw_draft", draw_with_top_p_report_without)  # the batched draft's


def verify_tree_skipping_duplicates(tree, target_probs, mode, generator=None, **_):
    """(c) Known-wrong in iid mode: a sibling whose token was already rejected is skipped, so the
    residual is not updated again (docs/algorithms.md, Tree verification: duplicates are separate
    nodes; never skip them)."""
    if mode != "iid":
        return verify_tree(tree, target_probs, mode, generator=generator)
    uniforms = torch.rand(len(tree.parents) - 1, generator=generator, dtype=torch.float64)
    final_uniform = torch.rand((), generator=generator, dtype=torch.float64).item()
    children, node, accepted = tree.children(), 0, []
    while children[node]:
        p, q = target_probs[node].double(), tree.draft_probs[node].double()
        tried, chosen = set(), None
        for child in children[node]:
            token = tree.tokens[child]
            if token in tried:
                continue  # the bug
            tried.add(token)
            if float(uniforms[child - 1]) * q[token] < p[token]:
                chosen = child
                break
            residual = (p - q).clamp(min=0)
            p = residual / residual.sum() if residual.sum() > 0 else p
        if chosen is None:
            return TreeResult([tree.tokens[n] for n in accepted] + [sample(p, final_uniform)], accepted, "recovered")
        accepted.append(chosen)
        node = chosen
    bonus = sample(target_probs[node].double(), final_uniform)
    return TreeResult([tree.tokens[n] for n in accepted] + [bonus], accepted, "bonus")


def break_chain_resampling(monkeypatch):
    for module in (engine_module, batch_engine_module):
        monkeypatch.setattr(module, "verify_chain", resample_from_target_after_rejection)


def break_tree_duplicates(monkeypatch):
    for module in (engine_module, batch_engine_module):
        monkeypatch.setattr(module, "verify_tree", verify_tree_skipping_duplicates)


BROKEN = {  # name: (how to break it, the CORRECT setting it runs in, samples at which it fails)
    "a-resample-from-p": (break_chain_resampling, "chain-t1", 1200),
    "b-q-without-top-p": (report_q_without_top_p, "chain-t2-p0.5", 800),
    "c-tree-skips-duplicates": (break_tree_duplicates, "tree-iid", 600),
}


@pytest.mark.parametrize("engine", ["sequential", "batched"])
@pytest.mark.parametrize("name", list(BROKEN))
def test_broken_variant_fails(pair, monkeypatch, name, engine):
    breaker, setting, samples = BROKEN[name]
    drafter, sampling, spec = CORRECT[setting]
    breaker(monkeypatch)
    report = audit(make_engine(pair, drafter) if engine == "sequential" else make_batched(pair, spec), sampling,
                   spec, samples)
    assert report.verdict == "FAIL", (report.p_value, report.tv, report.noise_floor)
    assert report.tv > report.noise_floor


# ---- reproducibility and notes -----------------------------------------------------------------------


def test_seeded_runs_reproduce_exactly(pair):
    engine = make_engine(pair, "model")
    first, again = (audit(engine, T1, SpecConfig(gamma=2), 60, seed=7) for _ in range(2))
    assert first.as_dict() == again.as_dict()
    assert audit(engine, T1, SpecConfig(gamma=2), 60, seed=8).as_dict() != first.as_dict()


def test_a_continuation_too_short_to_draft_gets_a_note(pair):
    report = audit(make_engine(pair, "model"), T1, SpecConfig(gamma=2), 50, tokens=2)
    assert report.prompts[0].drafted == 0 and "no draft was verified" in report.notes[0]


def test_prompt_ids_outside_the_vocabulary_are_refused(pair):
    with pytest.raises(VerispecError, match="0..3"):
        run_audit(make_engine(pair, "model"), [[1, 9]], T1, SpecConfig(), AuditConfig(samples=50))


# ---- command line ------------------------------------------------------------------------------------


def run_cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_json(capsys, pair_dirs):
    target, draft = pair_dirs
    code, out, _ = run_cli(capsys, "audit", "--target", str(target), "--draft", str(draft), "--prompt-ids",
                           "1,2,3,0,2", "--prompt-ids", "3,1", "--tokens", "3", "--samples", "60", "--gamma", "2",
                           "--seed", "5", "--json")
    data = json.loads(out)
    assert code == 0 and data["verdict"] == "pass"
    for key in ("tv", "p_value", "noise_floor", "samples", "tokens", "config", "prompts"):
        assert key in data
    assert data["samples"] == 60 and data["tokens"] == 3 and len(data["prompts"]) == 2
    assert data["config"]["sampling"]["temperature"] == 1.0  # audit samples by default
    assert data["config"]["spec"]["gamma"] == 2
    assert data["prompts"][0]["prompt_ids"] == [1, 2, 3, 0, 2]


def test_cli_rows_1_decodes_one_at_a_time_with_the_same_report(capsys):
    """The embedded pair, its draft with native weights: the default batched audit and --rows 1 (SpecEngine)
    report the same figures for a seed, a regex constraint included. (With int8 draft weights, passes of
    more than 4 rows use bf16 weights, so a seed's sequence moves with the batch: not so here.)"""
    argv = ["audit", "--target", "tiny", "--draft-weights", "native", "--samples", "60", "--tokens", "4",
            "--regex", "[a-f][a-f0-9]{1,5}", "--seed", "2", "--json"]
    code, out, _ = run_cli(capsys, *argv)
    data = json.loads(out)
    assert code == 0 and data["prompts"][0]["distinct"] > 5 and data["prompts"][0]["drafted"] > 0
    assert run_cli(capsys, *argv, "--rows", "1")[:2] == (0, out)


def test_cli_audits_the_draft_as_generate_runs_it(capsys, monkeypatch):
    """--draft-vocab (auto: 2048 for the embedded draft) and --draft-weights reach the audited drafter."""
    import verispec.audit as audit_module

    seen = {}

    def capture(engine, prompts, sampling, spec, config, **_):
        assert isinstance(engine, BatchEngine) and engine.max_batch == 64  # the default --rows
        seen.update(vocab=engine.draft.head.get("vocab_limit"), spec_vocab=spec.draft_vocab,
                    int8=any(getattr(m, "quantized", None) is not None for m in engine.draft.model.modules()))
        raise VerispecError("captured")

    monkeypatch.setattr(audit_module, "run_audit", capture)
    assert run_cli(capsys, "audit", "--target", "tiny", "--samples", "50")[0] == 2
    from verispec import kernels

    assert seen == {"vocab": 2048, "spec_vocab": 2048, "int8": kernels.library() is not None}
    assert run_cli(capsys, "audit", "--target", "tiny", "--samples", "50", "--draft-vocab", "100",
                   "--draft-weights", "native")[0] == 2
    assert seen == {"vocab": 100, "spec_vocab": 100, "int8": False}


def test_cli_exit_status_1_on_fail(capsys, pair_dirs, monkeypatch):
    def accept_everything(draft_tokens, draft_probs, target_probs, generator=None, **_):
        bonus = int(sample_batch(target_probs[-1][None], torch.rand(1, generator=generator, dtype=torch.float64))[0])
        return ChainResult(draft_tokens.tolist() + [bonus], len(draft_tokens), "bonus")

    monkeypatch.setattr(batch_engine_module, "verify_chain", accept_everything)  # the CLI's batched engine
    target, draft = pair_dirs
    code, out, _ = run_cli(capsys, "audit", "--target", str(target), "--draft", str(draft), "--prompt-ids",
                           "1,2,3,0,2", "--tokens", "3", "--samples", "200", "--gamma", "2")
    assert code == 1 and out.strip().splitlines()[-1].startswith("verdict: FAIL")


def test_cli_text_prompts_and_human_output(capsys, tmp_path):
    target = tmp_path / "byte_target"
    vocab = make_byte_tokenizer(target)
    make_checkpoint(target, vocab, hidden=32, layers=2, seed=3, via_transformers=False)
    code, out, _ = run_cli(capsys, "audit", "--target", str(target), "--method", "self", "--exit-layer", "1",
                           "--prompt", "abab", "--tokens", "3", "--samples", "50", "--top-k", "3")
    assert code == 0, out
    lines = out.strip().splitlines()
    assert "TV" in lines[1] and "'abab'" in lines[2] and lines[-1].startswith("verdict: pass")


@pytest.mark.parametrize("extra,message", [
    (["--tokens", "0"], "--tokens must be in 1..8"),
    (["--tokens", "9"], "--tokens must be in 1..8"),
    (["--samples", "49"], "--samples must be >= 50"),
    (["--alpha", "1.5"], "--alpha must be in (0, 1)"),
    (["--rows", "0"], "--rows must be >= 1"),
    (["--temperature", "-1"], "temperature must be >= 0"),
    (["--prompt-ids", "1,x"], "--prompt-ids must be comma-separated"),
    (["--prompt-ids", "1,99"], "prompt token ids must be in 0..3"),
])
def test_cli_bad_input_exits_2_with_one_line(capsys, pair_dirs, extra, message):
    target, draft = pair_dirs
    code, out, err = run_cli(capsys, "audit", "--target", str(target), "--draft", str(draft), *extra)
    assert code == 2 and out == ""
    assert err.startswith("verispec: error: ") and message in err and err.count("\n") == 1
