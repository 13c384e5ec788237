"""The lossless checks with the models and tensors on a CUDA device.

Greedy speculative decoding equals plain decoding for models on the device (SpecEngine with every
drafting method, BatchEngine with several rows); logits on the device agree with the CPU's; the chain
and tree verifiers and the sampling transform, run on device tensors, replay the CPU's draws token for
token and their first committed token follows p (chi-square); sequences sampled by an engine whose
models live on the device follow the target's exact distribution.

Skipped where there is no CUDA device (CI has none): run them on a GPU machine. Setting
``VERISPEC_TEST_DEVICE=cpu`` runs the same checks on the CPU, which is how the tests themselves are
checked on machines without a GPU.
"""

from __future__ import annotations

import itertools
import math
import os
from pathlib import Path

import pytest
import torch
from scipy.stats import chisquare

from verispec.batch import BatchEngine, BatchRequest
from verispec.config import SamplingParams, SpecConfig, StopRules
from verispec.engine import SpecEngine
from verispec.engine_factory import ModelPair, build_engine
from verispec.models.llama import load_checkpoint
from verispec.sampling import logits_to_probs, sample_batch
from verispec.testing import make_checkpoint
from verispec.tree import TokenTree
from verispec.verify.chain import verify_chain_batch
from verispec.verify.tree import verify_tree

DEVICE = os.environ.get("VERISPEC_TEST_DEVICE", "cuda")
pytestmark = pytest.mark.skipif(DEVICE.startswith("cuda") and not torch.cuda.is_available(),
                                reason="no CUDA device on this machine; these tests run on a GPU machine "
                                       "(VERISPEC_TEST_DEVICE=cpu runs them on the CPU)")

GREEDY = SamplingParams(temperature=0.0)
SETTINGS = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_k=3, top_p=0.9, min_p=0.1)]
PROMPT = [3, 14, 15, 9, 26, 5]
ALPHA = 1e-4  # a chi-square p-value below this fails (a correct sampler fails one run in 10^4)


@pytest.fixture(scope="module")
def on_device(checkpoints):
    return {name: load_checkpoint(path, device=DEVICE) for name, path in checkpoints.items()}


@pytest.fixture(scope="module")
def hf_on_device(checkpoints):
    """The same checkpoints through transformers (one sequence per cache: BatchEngine runs them in RowLoop)."""
    from verispec.models.hf import load_hf_checkpoint

    return {name: load_hf_checkpoint(checkpoints[name], device=DEVICE) for name in ("llama", "draft")}


def pair_of(target, draft=None) -> ModelPair:
    return ModelPair(target, draft, None, Path("target"), None)


def test_models_on_the_device_give_the_cpu_logits(checkpoints, on_device):
    ids = torch.tensor([PROMPT + [7, 1, 40]])
    for name in ("llama", "qwen2", "draft"):
        cpu = load_checkpoint(checkpoints[name]).train_forward(ids)[0]
        device = on_device[name].train_forward(ids.to(DEVICE))[0]
        assert device.device.type == torch.device(DEVICE).type
        torch.testing.assert_close(device.cpu(), cpu, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("spec", [SpecConfig(gamma=1), SpecConfig(gamma=4), SpecConfig(gamma=4, draft_vocab=20),
                                  SpecConfig(method="tree", tree="s3_k2_d6"), SpecConfig(method="tree", tree="dynamic:6"),
                                  SpecConfig(gamma=3, drafter="ngram"), SpecConfig(gamma=3, drafter="early_exit",
                                                                                   exit_layer=1)],
                         ids=["chain-g1", "chain-g4", "chain-vocab20", "tree-s3k2d6", "tree-dynamic6", "ngram", "self"])
@pytest.mark.parametrize("target_name", ["llama", "qwen2"])
def test_greedy_speculation_equals_plain_decoding_on_the_device(on_device, spec, target_name):
    target = on_device[target_name]
    draft = on_device["draft_qwen2" if target_name == "qwen2" else "draft"]
    stop = StopRules(max_tokens=40, ignore_eos=True)
    plain = SpecEngine(target).generate(PROMPT, GREEDY, SpecConfig(method="none"), stop).tokens
    result = build_engine(pair_of(target, draft), spec).generate(PROMPT, GREEDY, spec, stop)
    assert result.tokens == plain
    assert result.stats.drafted > 0  # speculation ran


@pytest.mark.parametrize("spec", [SpecConfig(gamma=4), SpecConfig(method="tree", tree="s3_k2_d6"),
                                  SpecConfig(gamma=3, drafter="ngram")], ids=["chain", "tree", "ngram"])
@pytest.mark.parametrize("sampling", [GREEDY, SETTINGS[1]], ids=["greedy", "sampled"])
@pytest.mark.parametrize("models", ["on_device", "hf_on_device"], ids=["native", "hf"])
def test_batched_rows_on_the_device_decode_as_alone(request, models, spec, sampling):
    """Several rows through BatchEngine on the device: each row's tokens are what SpecEngine gives that
    request alone (per-row generators: sampled rows too); greedy rows are plain decoding's. Also for the
    transformers-backed models, whose rows run one pass each (RowLoop)."""
    models = request.getfixturevalue(models)
    target, draft = models["llama"], models["draft"]
    prompts = [PROMPT, [1, 2, 3], [60, 61, 5, 9, 9, 2, 33, 8], [4] * 11]
    engine = BatchEngine(target, draft, spec, max_batch=3)
    queue = [BatchRequest(str(i), p, sampling, StopRules(max_tokens=24 + 3 * i, ignore_eos=True), seed=i)
             for i, p in enumerate(prompts)]
    out: dict[str, list[int]] = {}
    finished = set()
    while queue or engine.active:
        events = []
        while queue and engine.has_capacity:
            events += engine.add(queue.pop(0))
        events += engine.step()
        for event in events:
            out.setdefault(event.request_id, []).extend(event.tokens)
            if event.finished:
                finished.add(event.request_id)
    assert finished == {str(i) for i in range(len(prompts))}
    single = build_engine(pair_of(target, draft), spec)
    plain = SpecEngine(target)
    for i, prompt in enumerate(prompts):
        stop = StopRules(max_tokens=24 + 3 * i, ignore_eos=True)
        assert out[str(i)] == single.generate(prompt, sampling, spec, stop, seed=i).tokens, i
        if sampling.greedy:
            assert out[str(i)] == plain.generate(prompt, GREEDY, SpecConfig(method="none"), stop).tokens, i


@pytest.mark.parametrize("params", SETTINGS + [GREEDY], ids=["t1", "t0.8-k3-p0.9-m0.1", "greedy"])
def test_the_sampling_transform_and_draws_on_the_device_are_the_cpus(params):
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(64, 50, generator=generator) * 3
    cpu = logits_to_probs(logits, params)
    device = logits_to_probs(logits.to(DEVICE), params)
    assert torch.equal(device.cpu() > 0, cpu > 0)  # the same support: every filter kept the same tokens
    torch.testing.assert_close(device.cpu(), cpu, atol=1e-6, rtol=1e-5)
    uniforms = torch.rand(64, generator=generator, dtype=torch.float64)
    assert torch.equal(sample_batch(device, uniforms).cpu(), sample_batch(cpu, uniforms))


def expected_counts(probs: torch.Tensor, total: int):
    """``total`` draws' expected counts under ``probs``, summing to ``total`` as chisquare requires."""
    probs = probs.double()
    return (probs / probs.sum() * total).numpy()


def _chain_case(generator, rows: int, drafts: int, vocab: int, point_mass: bool):
    p = torch.softmax(torch.randn(drafts + 1, vocab, generator=generator) * 1.5, -1)
    q = torch.softmax(torch.randn(drafts, vocab, generator=generator) * 1.5, -1)
    if point_mass:  # greedy / n-gram drafts: q one-hot on the drafted token
        tokens = torch.randint(vocab, (rows, drafts), generator=generator)
        probs = None
    else:
        tokens = torch.stack([torch.multinomial(q[i], rows, replacement=True, generator=generator)
                              for i in range(drafts)], 1)  # (rows, K): x_i ~ q_i
        probs = q.expand(rows, drafts, vocab)
    uniforms = torch.rand(rows, drafts, generator=generator, dtype=torch.float64)
    finals = torch.rand(rows, generator=generator, dtype=torch.float64)
    return p, tokens, probs, uniforms, finals


@pytest.mark.parametrize("point_mass", [False, True], ids=["sampled-q", "point-mass-q"])
def test_chain_verification_on_the_device(point_mass):
    """Draw for draw the device's verdicts are the CPU's; the first committed token follows p_1."""
    rows, drafts, vocab = 20_000, 3, 6
    p, tokens, probs, uniforms, finals = _chain_case(torch.Generator().manual_seed(11), rows, drafts, vocab,
                                                     point_mass)
    target = p.expand(rows, drafts + 1, vocab)
    cpu = verify_chain_batch(tokens, probs, target, uniforms, finals)
    device = verify_chain_batch(tokens.to(DEVICE), None if probs is None else probs.to(DEVICE),
                                target.to(DEVICE), uniforms.to(DEVICE), finals.to(DEVICE))
    for a, b in zip(cpu, device):
        assert torch.equal(b.cpu(), a)
    first = torch.bincount(device[1][:, 0].cpu(), minlength=vocab).double()
    assert chisquare(first.numpy(), expected_counts(p[0], rows)).pvalue > ALPHA


@pytest.mark.parametrize("mode", ["deterministic", "iid", "without_replacement"])
def test_tree_verification_on_the_device(mode):
    """A root with three drafted children (each with one child): the device's verdicts are the CPU's
    for the same uniforms, and the first committed token follows p at the root."""
    generator = torch.Generator().manual_seed(5)
    vocab, trials = 5, 3000
    parents = [-1, 0, 0, 0, 1, 2, 3]
    p = torch.softmax(torch.randn(len(parents), vocab, generator=generator) * 1.5, -1)
    q = torch.softmax(torch.randn(len(parents), vocab, generator=generator) * 1.5, -1)
    counts = torch.zeros(vocab, dtype=torch.float64)
    for _ in range(trials):
        if mode == "without_replacement":
            siblings = torch.multinomial(q[0], 3, replacement=False, generator=generator).tolist()
        elif mode == "iid":
            siblings = torch.multinomial(q[0], 3, replacement=True, generator=generator).tolist()
        else:
            siblings = torch.randperm(vocab, generator=generator)[:3].tolist()
        grandchildren = [int(torch.multinomial(q[i + 1], 1, generator=generator)) for i in range(3)]
        tokens = [0] + siblings + grandchildren
        uniforms = torch.rand(len(parents) - 1, generator=generator, dtype=torch.float64)
        final = float(torch.rand((), generator=generator, dtype=torch.float64))
        cpu = verify_tree(TokenTree(parents, tokens, q), p, mode, uniforms, final)
        device = verify_tree(TokenTree(parents, tokens, q.to(DEVICE)), p.to(DEVICE), mode, uniforms.to(DEVICE), final)
        assert (device.tokens, device.accepted_nodes, device.last_kind) == (cpu.tokens, cpu.accepted_nodes,
                                                                             cpu.last_kind)
        counts[device.tokens[0]] += 1
    assert chisquare(counts.numpy(), expected_counts(p[0], trials)).pvalue > ALPHA


VOCAB, LENGTH, SAMPLES = 4, 4, 2000
SMALL_PROMPT = [1, 2, 3, 0, 2]


@pytest.fixture(scope="module")
def small_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("cuda-small")
    target = load_checkpoint(make_checkpoint(root / "t", VOCAB, hidden=32, layers=2, seed=21), device=DEVICE)
    draft = load_checkpoint(make_checkpoint(root / "d", VOCAB, hidden=16, layers=1, heads=2, kv_heads=1, seed=22),
                            device=DEVICE)
    return target, draft


def exact_distribution(target, sampling: SamplingParams) -> dict[tuple[int, ...], float]:
    """Every LENGTH-token continuation's probability under the target alone (teacher forcing)."""
    table = {}
    with torch.no_grad():
        for seq in itertools.product(range(VOCAB), repeat=LENGTH):
            ids = torch.tensor([SMALL_PROMPT + list(seq[:-1])], device=DEVICE)
            probs = logits_to_probs(target.train_forward(ids)[0][0, len(SMALL_PROMPT) - 1:].cpu(), sampling)
            table[seq] = math.prod(float(probs[i, token]) for i, token in enumerate(seq))
    return table


@pytest.mark.parametrize("spec", [SpecConfig(gamma=2), SpecConfig(method="tree", tree="s2_k2_d4",
                                                                   sibling_mode="without_replacement")],
                         ids=["chain", "tree"])
@pytest.mark.parametrize("sampling", SETTINGS, ids=["t1", "t0.8-k3-p0.9-m0.1"])
def test_sequences_sampled_on_the_device_follow_the_target(small_pair, spec, sampling):
    target, draft = small_pair
    expected = exact_distribution(target, sampling)
    engine = build_engine(pair_of(target, draft), spec)
    stop = StopRules(max_tokens=LENGTH, ignore_eos=True)
    counts: dict[tuple[int, ...], int] = {}
    drafted = 0
    for seed in range(SAMPLES):
        result = engine.generate(SMALL_PROMPT, sampling, spec, stop, seed=seed)
        counts[tuple(result.tokens)] = counts.get(tuple(result.tokens), 0) + 1
        drafted += result.stats.drafted
    assert drafted > 0
    assert set(counts) <= {k for k, v in expected.items() if v > 0}, "sampled a zero-probability sequence"
    big = [k for k, v in expected.items() if v * SAMPLES >= 5]
    observed = [counts.get(k, 0) for k in big] + [SAMPLES - sum(counts.get(k, 0) for k in big)]
    predicted = [expected[k] * SAMPLES for k in big]
    predicted.append(SAMPLES - sum(predicted))
    if predicted[-1] < 1e-6:  # no mass outside the big cells
        observed, predicted = observed[:-1], [v * SAMPLES / sum(predicted[:-1]) for v in predicted[:-1]]
    assert chisquare(observed, predicted).pvalue > ALPHA


@pytest.mark.parametrize("spec", [SpecConfig(gamma=2), SpecConfig(method="tree", tree="s2_k2_d4")],
                         ids=["chain", "tree"])
def test_the_batched_audit_on_the_device_passes_as_the_sequential_one_does(small_pair, spec):
    from verispec.audit import AuditConfig, SharedPrefill, audit_engine, run_audit

    target, draft = small_pair
    pair = pair_of(target, draft)
    sampling, config = SETTINGS[1], AuditConfig(tokens=LENGTH, samples=400, seed=5)
    batched = audit_engine(pair, spec, rows=16, context=len(SMALL_PROMPT) + LENGTH)
    assert isinstance(batched, BatchEngine) and isinstance(batched.target, SharedPrefill)
    report = run_audit(batched, [SMALL_PROMPT], sampling, spec, config)
    assert report.verdict == "pass" and report.prompts[0].drafted > 0
    # The same seeds one generation at a time (SpecEngine) pass too; the tokens may differ where a GPU
    # library picks another kernel for 16 rows than for one, the distribution may not.
    alone = run_audit(audit_engine(pair, spec, rows=1), [SMALL_PROMPT], sampling, spec, config)
    assert alone.verdict == "pass" and alone.prompts[0].drafted > 0
