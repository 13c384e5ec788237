"""The EAGLE-style feature head: the target hands over its features from passes it runs anyway, the
head drafts chains and trees, every method stays lossless (greedy identity with plain decoding on the
embedded target; exact-distribution tests for the reduced-vocabulary head under sampling), training's
unrolled steps compute what drafting computes, and the head survives a save and load."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from test_engine_statistical import PROMPT, VOCAB, agreement, exact_target_distribution
from verispec import kernels
from verispec.config import SamplingParams, SpecConfig, StopRules
from verispec.drafters.eagle import EagleDrafter
from verispec.engine import SpecEngine
from verispec.errors import CheckpointError
from verispec.models.eagle import EagleHead, for_inference, load_eagle, save_eagle
from verispec.models.llama import load_checkpoint
from verispec.testing import make_checkpoint
from verispec.train.eagle import EagleRecipe, eagle_loss, unrolled_attention_mask, unrolled_predictions


def frozen_head(target, draft_vocab: int, seed: int = 0, accelerate: bool = True) -> EagleHead:
    """An untrained head with perturbed weights (so its drafts are neither all right nor all wrong)."""
    torch.manual_seed(seed)
    head = EagleHead.for_target(target, draft_vocab)
    with torch.no_grad():
        for parameter in (*head.fc.parameters(), *head.body.model.layers.parameters()):
            parameter.add_(0.02 * torch.randn_like(parameter))
    return for_inference(head, accelerate)


@pytest.fixture(scope="module")
def embedded():
    from verispec.loading import load_pair

    pair = load_pair("tiny", need_draft=False)
    return pair.target, pair.tokenizer


def test_features_come_from_the_same_pass(embedded):
    """with_features returns the very logits of the plain pass, and the features are what the LM head
    reads (head_logits of them gives those logits), on the one-call path and the step path."""
    target, _ = embedded
    ids = torch.tensor([[5, 9, 31, 7, 200, 11]])
    with torch.inference_mode():
        for last_only in (False, True):
            plain = target.forward(ids, target.new_cache(1, 32), last_only=last_only)
            logits, features = target.forward(ids, target.new_cache(1, 32), last_only=last_only, with_features=True)
            assert torch.equal(plain, logits) and features.shape == (1, 6, target.config.hidden_size)
            rows = features[:, -1:] if last_only else features
            torch.testing.assert_close(target.head_logits(rows), logits, rtol=1e-5, atol=1e-5)
            steps = target._steps(ids, target.new_cache(1, 32), None, None, last_only, None, 0, None, True)
            torch.testing.assert_close(steps[1], features, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("spec", [
    SpecConfig(method="chain", gamma=3, drafter="eagle"),
    SpecConfig(method="chain", gamma=6, drafter="eagle"),
    SpecConfig(method="tree", tree="s3_k2_d6", drafter="eagle"),
    SpecConfig(method="tree", tree="s4_k3_d9", drafter="eagle"),
    SpecConfig(method="tree", tree="dynamic:8", drafter="eagle"),
    SpecConfig(method="tree", tree="dynamic:16", drafter="eagle"),
], ids=["chain3", "chain6", "s3_k2_d6", "s4_k3_d9", "dynamic8", "dynamic16"])
def test_greedy_eagle_equals_plain_decoding(embedded, spec):
    target, tokenizer = embedded
    head = frozen_head(target, 2048)
    stop = StopRules(max_tokens=48, eos_ids=())
    greedy = SamplingParams(temperature=0)
    plain = SpecEngine(target, None)
    engine = SpecEngine(target, EagleDrafter(head, target.config.max_context))
    for prompt in ("def parse(line):\n    ", "The capital of France is", "12 + 30 ="):
        ids = tokenizer(prompt)["input_ids"]
        expected = plain.generate(ids, greedy, SpecConfig(method="none"), stop).tokens
        result = engine.generate(ids, greedy, spec, stop)
        assert result.tokens == expected, prompt
        assert result.stats.summary()["drafted"] > 0


@pytest.fixture(scope="module")
def small_target(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle_small")
    return load_checkpoint(make_checkpoint(root / "t", VOCAB, hidden=32, layers=2, seed=21))


SAMPLINGS = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_p=0.9),
             SamplingParams(temperature=1.0, top_k=3)]


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["t1", "t0.7-p0.9", "t1-k3"])
def test_reduced_vocabulary_head_keeps_the_target_distribution(small_target, sampling):
    """A head over ids < 2 only (q is 0 on 2 and 3): 2000 sampled 4-token continuations, chain gamma 2,
    follow the target's exact distribution (chi-square and total variation, as for draft models)."""
    head = frozen_head(small_target, draft_vocab=2, seed=3)
    engine = SpecEngine(small_target, EagleDrafter(head, 64))
    expected = exact_target_distribution(small_target, sampling)
    counts: dict[tuple[int, ...], int] = {}
    accepted = 0
    for seed in range(2000):
        result = engine.generate(PROMPT, sampling, SpecConfig(method="chain", gamma=2, drafter="eagle"),
                                 StopRules(max_tokens=4), seed=seed)
        counts[tuple(result.tokens)] = counts.get(tuple(result.tokens), 0) + 1
        accepted += result.stats.summary()["accepted"]
    assert accepted > 0  # drafts were really accepted (and, with ids 2 and 3 undraftable, rejected)
    p_value, tv, bound = agreement(expected, counts)
    assert p_value > 1e-4 and tv < bound, (p_value, tv, bound)


@pytest.mark.parametrize("mode", ["iid", "without_replacement"])
def test_sampled_eagle_trees_keep_the_target_distribution(small_target, mode):
    sampling = SamplingParams(temperature=1.0)
    head = frozen_head(small_target, draft_vocab=VOCAB, seed=4)
    engine = SpecEngine(small_target, EagleDrafter(head, 64))
    spec = SpecConfig(method="tree", tree="s2_k2_d4", drafter="eagle", sibling_mode=mode)
    expected = exact_target_distribution(small_target, sampling)
    counts: dict[tuple[int, ...], int] = {}
    for seed in range(2000):
        tokens = tuple(engine.generate(PROMPT, sampling, spec, StopRules(max_tokens=4), seed=seed).tokens)
        counts[tokens] = counts.get(tokens, 0) + 1
    p_value, tv, bound = agreement(expected, counts)
    assert p_value > 1e-4 and tv < bound, (p_value, tv, bound)


def test_unrolled_attention_mask():
    """Step 1 is causal; step 2 at pair j sees step 1's pairs 0..j-1 and its own pair j; step 3 at
    pair j sees step 1's 0..j-2, step 2's j-1 and its own j."""
    assert torch.equal(unrolled_attention_mask(3, 1), torch.tensor([[1, 0, 0], [1, 1, 0], [1, 1, 1]]).bool())
    step3 = unrolled_attention_mask(4, 3).int()
    assert step3[3].tolist() == [1, 1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1]
    assert step3[2].tolist() == [1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 0]


def test_training_steps_compute_what_drafting_computes(small_target):
    """The unrolled step-2 and step-3 predictions at pair j equal what the drafter computes there when
    the context is committed up to token j and the drafts are the window's own tokens j+1, j+2."""
    head = frozen_head(small_target, VOCAB, seed=5, accelerate=False)
    torch.manual_seed(0)
    tokens = torch.randint(0, VOCAB, (1, 12))
    with torch.inference_mode():
        features = small_target.model.norm(small_target.train_hidden(tokens)[0])
    with torch.no_grad():
        steps = unrolled_predictions(head, features[:, :-1], tokens[:, 1:], 3)
    drafter = EagleDrafter(head, 64)
    for j in (2, 5, 9):
        drafter.reset()
        drafter.observe(features[0, :j])  # pairs 0..j-1: tokens 0..j committed
        with torch.inference_mode():
            first = drafter._catch_up(tokens[0, :j + 1].tolist())
            second = drafter._step(first[None], [int(tokens[0, j + 1])])[-1]
            drafter.cache.commit(0, 1)
            third = drafter._step(second[None], [int(tokens[0, j + 2])])[-1]
        torch.testing.assert_close(first, steps[0][0, j - 1], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(second, steps[1][0, j], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(third, steps[2][0, j + 1], rtol=1e-4, atol=1e-5)


def test_training_lowers_the_loss(small_target):
    torch.manual_seed(1)
    head = EagleHead.for_target(small_target, VOCAB)
    tokens = torch.randint(0, VOCAB, (4, 17))
    with torch.inference_mode():
        features = small_target.model.norm(small_target.train_hidden(tokens)[0])
    features = features.clone()
    recipe = EagleRecipe(draft_vocab=VOCAB, unroll=2)
    optimizer = torch.optim.AdamW(head.trainable_parameters(), lr=3e-3)
    first = None
    for _ in range(30):
        loss, scalars = eagle_loss(head, tokens, features, recipe)
        first = loss.item() if first is None else first
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert loss.item() < 0.7 * first and {"match_1", "match_2", "ce_1", "ce_2"} <= set(scalars)


def test_save_and_load_round_trip(small_target, tmp_path):
    head = frozen_head(small_target, 3, seed=6, accelerate=False)
    save_eagle(head, tmp_path / "head", "test")
    config = json.loads((tmp_path / "head" / "config.json").read_text())
    assert config["verispec_eagle"] and config["verispec_draft_vocab"] == 3
    loaded = load_eagle(tmp_path / "head", small_target, kernels=False)
    assert loaded.draft_vocab == 3 and loaded.body.model.embed_tokens.weight is small_target.model.embed_tokens.weight
    assert torch.equal(loaded.fc.weight, head.fc.weight.to(torch.bfloat16).float())
    layer, original = loaded.body.model.layers[0].state_dict(), head.body.model.layers[0].state_dict()
    assert all(torch.equal(layer[name], original[name].to(torch.bfloat16).float()) for name in original)
    with pytest.raises(CheckpointError, match="not a verispec EAGLE head"):
        load_eagle(tmp_path, small_target)


def test_cli_generate_with_eagle_equals_no_spec(embedded, tmp_path):
    target, _ = embedded
    save_eagle(frozen_head(target, 2048, accelerate=False), tmp_path / "head", "tiny")
    outputs = {}
    for name, extra in {"plain": ["--no-spec"], "eagle": ["--method", "eagle", "--eagle", str(tmp_path / "head")],
                        "tree": ["--method", "eagle", "--eagle", str(tmp_path / "head"), "--tree", "dynamic:8"]}.items():
        proc = subprocess.run([sys.executable, "-m", "verispec.cli", "generate", "def add(a, b):", "--target", "tiny",
                               "--max-tokens", "24", "--json", *extra], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        outputs[name] = json.loads(proc.stdout)["tokens"]
    assert outputs["eagle"] == outputs["plain"] == outputs["tree"]


def test_cli_refuses_a_directory_that_is_not_a_head(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "verispec.cli", "generate", "x", "--target", "tiny",
                           "--method", "eagle", "--eagle", str(tmp_path)], capture_output=True, text=True)
    assert proc.returncode == 2 and "not an EAGLE head directory" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr


def test_batched_eagle_chains_equal_plain_decoding(embedded):
    """The server's engine: each row's head drafts from the features of the batched verification;
    five requests through four rows (one joins when another leaves) give plain decoding's tokens."""
    from verispec.batch import BatchEngine, BatchRequest

    target, tokenizer = embedded
    head = frozen_head(target, 2048)
    prompts = ["def parse(line):\n    ", "The capital of France is", "12 + 30 =", "import os\n", "Once upon"]
    greedy = SamplingParams(temperature=0)
    plain = SpecEngine(target, None)
    expected, got = {}, {}
    for index, prompt in enumerate(prompts):
        ids = tokenizer(prompt)["input_ids"]
        stop = StopRules(max_tokens=20 + 4 * index, eos_ids=())
        expected[str(index)] = plain.generate(ids, greedy, SpecConfig(method="none"), stop).tokens
    engine = BatchEngine(target, None, SpecConfig(method="chain", gamma=4, drafter="eagle"), max_batch=4, eagle=head)
    waiting = [BatchRequest(str(i), tokenizer(p)["input_ids"], greedy, StopRules(max_tokens=20 + 4 * i, eos_ids=()))
               for i, p in enumerate(prompts)]
    events = []
    while waiting or engine.active:
        while waiting and engine.has_capacity:
            events += engine.add(waiting.pop(0))
        events += engine.step()
    for event in events:
        got.setdefault(event.request_id, []).extend(event.tokens)
    assert got == expected
    drafted = [e.stats.summary()["drafted"] for e in events if e.finished]
    assert len(drafted) == 5 and min(drafted) > 0


def test_train_eagle_end_to_end_on_the_tiny_target(tmp_path, embedded):
    """``verispec train eagle`` in miniature: features cached as shards, a few steps, a head that loads,
    drafts, and leaves greedy output unchanged; a second run with no extraction trains on the cache."""
    from verispec.train.eagle import train_eagle

    recipe = EagleRecipe(draft_vocab=2048)
    metrics = train_eagle(recipe, minutes=0.03, extract_minutes=0.02, target_name="tiny", out_dir=tmp_path / "head",
                          run_dir=tmp_path / "run")
    shards = sorted((tmp_path / "run" / "features").glob("features-*.pt"))
    assert shards and metrics["extraction"]["new_tokens"] > 0 and metrics["training"]["steps"] >= 1
    assert set(metrics["heldout_greedy_match"]) == {"chat", "code", "math"}
    again = train_eagle(recipe, minutes=0.01, extract_minutes=0, target_name="tiny", out_dir=tmp_path / "head2",
                        run_dir=tmp_path / "run", init_dir=tmp_path / "head")
    assert again["extraction"] == {} and again["training"]["cached_windows"] == metrics["training"]["cached_windows"]
    target, tokenizer = embedded
    head = load_eagle(tmp_path / "head2", target)
    ids = tokenizer("def add(a, b):")["input_ids"]
    stop, greedy = StopRules(max_tokens=16, eos_ids=()), SamplingParams(temperature=0)
    expected = SpecEngine(target).generate(ids, greedy, SpecConfig(method="none"), stop).tokens
    result = SpecEngine(target, EagleDrafter(head, target.config.max_context)).generate(
        ids, greedy, SpecConfig(gamma=3, drafter="eagle"), stop)
    assert result.tokens == expected


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_extracted_features_are_the_targets_at_either_precision(tmp_path, embedded, precision):
    """Each cached shard holds the target's normed final features of its windows: fp32 ones rounded to
    bf16, or under ``--precision bf16`` the target's run under bfloat16 autocast (within a few bf16 ulps)."""
    from dataclasses import replace

    from verispec.train.eagle import extract_features, target_features
    from verispec.train.gguf_draft import load_teacher

    teacher = load_teacher("tiny")
    recipe = EagleRecipe(draft_vocab=2048, extract_batch=2)
    recipe = replace(recipe, optim=replace(recipe.optim, seq_len=32, precision=precision))
    summary = extract_features(teacher.model, teacher.encode, teacher.eos_id, teacher.render, recipe, 0.002, tmp_path)
    shard = torch.load(tmp_path / "features-00000.pt")
    assert summary["new_tokens"] == shard["tokens"].numel() > 0
    exact = target_features(teacher.model, shard["tokens"].long())
    error = (shard["features"].float() - exact).norm() / exact.norm()
    assert error < (2.5e-3 if precision == "fp32" else 1.5e-2)  # bf16 rounding alone: ~1.7e-3; autocast: ~4e-3
    assert shard["features"].dtype == torch.bfloat16


@pytest.mark.parametrize("accelerate", [True, False], ids=["kernel", "torch"])
def test_a_q8_0_head_holds_its_blocks_values_and_stays_lossless(embedded, accelerate):
    """Q8_0 weights (``round_to_q8_0``): the head's own layers hold exactly their blocks' values, within a
    block's step of the saved weights, the target's shared tensors untouched; greedy chains still equal
    plain decoding."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    target, tokenizer = embedded
    embedding = target.model.embed_tokens.weight.clone()
    native = frozen_head(target, 2048, seed=3, accelerate=False)
    head = for_inference(frozen_head(target, 2048, seed=3, accelerate=False), accelerate, weights="q8_0")
    own = [m for m in (*head.body.model.layers.modules(), head.fc) if isinstance(m, torch.nn.Linear)]
    assert own and all(m.gguf_blocks[0] == "Q8_0" for m in own)
    for layer, before in zip(own, [m for m in (*native.body.model.layers.modules(), native.fc)
                                   if isinstance(m, torch.nn.Linear)]):
        values = torch.from_numpy(dequantize(layer.gguf_blocks[1].numpy(), GGMLQuantizationType.Q8_0))
        assert torch.equal(layer.weight, values.float().reshape(layer.weight.shape))
        step = before.weight.abs().reshape(-1, 32).amax(1, keepdim=True) / 127  # a block's scale
        # half a step from rounding, up to 127 x 2^-11 steps more from the scale's own fp16 rounding
        assert ((layer.weight - before.weight).reshape(-1, 32).abs() <= step * (0.5 + 127 / 2048) + 1e-7).all()
        if accelerate:
            assert layer.packed.dtype in kernels.GGUF_DTYPES
    assert torch.equal(target.model.embed_tokens.weight, embedding)
    stop, greedy = StopRules(max_tokens=32, eos_ids=()), SamplingParams(temperature=0)
    ids = tokenizer("def parse(line):\n    ")["input_ids"]
    expected = SpecEngine(target, None).generate(ids, greedy, SpecConfig(method="none"), stop).tokens
    spec = SpecConfig(method="chain", gamma=3, drafter="eagle")
    assert SpecEngine(target, EagleDrafter(head, target.config.max_context)).generate(ids, greedy, spec, stop).tokens == expected
    with pytest.raises(ValueError, match="unknown head weights"):
        for_inference(head, False, weights="q4")


def test_load_pair_gives_the_head_q8_0_weights_unless_told_otherwise(embedded):
    from verispec.loading import load_pair

    def own(head):
        return [m for m in (*head.body.model.layers.modules(), head.fc) if isinstance(m, torch.nn.Linear)]
    auto = load_pair("tiny", need_draft=False, need_eagle=True)
    assert all(getattr(m, "gguf_blocks", ("",))[0] == "Q8_0" for m in own(auto.eagle))
    native = load_pair("tiny", need_draft=False, need_eagle=True, draft_weights="native")
    assert not any(hasattr(m, "gguf_blocks") for m in own(native.eagle))
    if kernels.library() is not None:
        int8 = load_pair("tiny", need_draft=False, need_eagle=True, draft_weights="int8")
        assert all(m.quantized is not None for m in own(int8.eagle) if isinstance(m, kernels.SmallRowsLinear))
