"""Training pipeline: split hygiene, checkable synthetic math, the shipped tokenizer, and losses that learn."""

from __future__ import annotations

import random
import re

import pytest
import torch
from transformers import AutoTokenizer

from verispec.loading import DATA_DIR
from verispec.models.llama import LlamaConfig, LlamaForCausalLM
from verispec.train import corpus
from verispec.train.chat_format import render_chat
from verispec.train.losses import distillation_loss, layerskip_loss
from verispec.train.recipes import LayerSkipConfig
from verispec.train.synthetic_math import make_problem
from verispec.train.target import init_weights


def test_split_is_stable_and_disjoint():
    ids = [f"doc-{i}" for i in range(3000)]
    heldout = {i for i in ids if corpus.is_heldout(i)}
    assert 0.015 < len(heldout) / len(ids) < 0.05
    assert heldout == {i for i in ids if corpus.is_heldout(i)}  # deterministic
    train, held = corpus.load_workload("math", "train"), corpus.load_workload("math", "heldout")
    assert held and not set(train) & set(held)


def test_synthetic_math_answers_are_correct():
    """Every step 'a op b = c' in the worked answer is arithmetic truth, and the final answer is c."""
    for index in range(300):
        problem = make_problem(index)
        steps = re.findall(r"(\d+) ([-+*/]) (\d+) = (\d+)", problem)
        assert steps, problem
        for a, op, b, c in steps:
            assert eval(f"{a} {op} {b}") == int(c), problem
        assert problem.endswith(f"The answer is {steps[-1][3]}.")


def test_shipped_tokenizer_loads_with_chat_template():
    tokenizer = AutoTokenizer.from_pretrained(str(DATA_DIR / "target"))
    assert len(tokenizer) == 8192 and tokenizer.eos_token == "<|endoftext|>" and tokenizer.eos_token_id == 0
    text = "def add(a, b):\n    return a + b  # ünïcode ok\n"
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text
    messages = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == render_chat(messages, add_generation_prompt=True)


def test_compacted_tokenizer_json_is_the_same_tokenizer_in_fewer_bytes(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from verispec.train.tokenizer import compact_tokenizer_json

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.train_from_iterator(["def f(x):\n    return x + 1\n"] * 20,
                                  trainer=trainers.BpeTrainer(vocab_size=300, show_progress=False))
    path = tmp_path / "tokenizer.json"
    tokenizer.save(str(path), pretty=True)
    pretty_size = path.stat().st_size
    compact_tokenizer_json(path)
    assert path.stat().st_size < 0.8 * pretty_size
    assert Tokenizer.from_file(str(path)).to_str() == tokenizer.to_str()


def test_shipped_model_files_fit_the_size_limit():
    """Issue 3: every committed model file (both checkpoint dirs, tokenizers included) in at most 40 MB."""
    files = [f for name in ("target", "draft") for f in (DATA_DIR / name).iterdir() if f.is_file()]
    assert {f.name for f in files} >= {"config.json", "model.safetensors", "tokenizer.json"}
    assert sum(f.stat().st_size for f in files) <= 40_000_000


def tiny(layers=3, hidden=32, seed=0, std=0.02):
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=hidden, intermediate_size=64,
                                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                         tie_word_embeddings=True))
    init_weights(model, std)
    return model


def repeating_batch():
    pattern = torch.tensor([3, 7, 11, 19, 23, 5, 9, 13])
    return pattern.repeat(4, 5)[:, :33]  # (B, T + 1)


def test_layerskip_loss_learns_and_trains_early_exits():
    model = tiny()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rng, tokens = random.Random(0), repeating_batch()
    config = LayerSkipConfig(max_dropout=0.2, exits_per_micro_batch=2, exit_loss_scale=0.5)
    first = last = None
    for step in range(60):
        loss, scalars = layerskip_loss(model, tokens, config, step, rng)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        first = first if first is not None else scalars
        last = scalars
    assert last["final_loss"] < 0.3 * first["final_loss"]
    assert any(key.startswith("exit") for key in last)


def test_distillation_pulls_the_draft_towards_the_teacher():
    teacher, draft = tiny(seed=1, std=0.3), tiny(layers=1, seed=2)  # a peaked, far-from-uniform teacher
    optimizer = torch.optim.AdamW(draft.parameters(), lr=1e-2)
    tokens = repeating_batch()
    kls = []
    for _ in range(40):
        loss, scalars = distillation_loss(draft, teacher, tokens, ce_weight=0.2)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        kls.append(scalars["kl"])
    assert kls[0] >= 0 and kls[-1] < 0.5 * kls[0]


def test_argmax_term_adds_cross_entropy_on_the_teachers_argmax():
    teacher, draft = tiny(seed=1, std=0.3), tiny(layers=1, seed=2)
    tokens = repeating_batch()
    with torch.no_grad():
        plain, _ = distillation_loss(draft, teacher, tokens, ce_weight=0.2)
        weighted, scalars = distillation_loss(draft, teacher, tokens, ce_weight=0.2, argmax_weight=0.5)
        argmax = teacher.train_forward(tokens[:, :-1])[0].argmax(dim=-1)
        reference = torch.nn.functional.cross_entropy(draft.train_forward(tokens[:, :-1])[0].reshape(-1, 50),
                                                      argmax.reshape(-1))
    assert scalars["argmax_ce"] == pytest.approx(reference.item(), rel=1e-5)
    assert (weighted - plain).item() == pytest.approx(0.5 * reference.item(), rel=1e-4)


def test_target_samples_equal_a_stateless_sampler_and_mix_at_the_set_fraction():
    """TargetSamples (batched KV-cached sampling) draws exactly what sampling from whole-sequence logits
    with the same generator draws; MixedBatches replaces every 4th micro-batch at fraction 0.25."""
    from verispec.train.draft import MixedBatches, TargetSamples

    torch.manual_seed(3)
    config = LlamaConfig(vocab_size=30, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    teacher = LlamaForCausalLM(config).eval()
    init_weights(teacher, 0.3)
    text = torch.randint(0, 30, (4, 12))
    windows = next(TargetSamples(teacher, iter([text]), prefix_len=5, seed=7))
    assert torch.equal(windows[:, :5], text[:, :5]) and windows.shape == text.shape
    generator = torch.Generator().manual_seed(7)
    expected = text[:, :5]
    with torch.no_grad():
        while expected.shape[1] < 12:
            probs = torch.softmax(teacher.train_forward(expected)[0][:, -1].float(), dim=-1)
            expected = torch.cat([expected, torch.multinomial(probs, 1, generator=generator)], dim=1)
    assert torch.equal(windows, expected)
    zeros, ones = torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 3, dtype=torch.long)
    mixed = MixedBatches(iter([zeros] * 6), iter([ones] * 2), 0.25)
    assert [int(next(mixed).sum() > 0) for _ in range(8)] == [0, 0, 0, 1, 0, 0, 0, 1]


def test_greedy_target_samples_follow_the_argmax():
    """With greedy_fraction 1 every generated token is the teacher's argmax given the window so far."""
    from verispec.train.draft import TargetSamples

    teacher = tiny(seed=4, std=0.3)
    text = torch.randint(0, teacher.config.vocab_size, (3, 10), generator=torch.Generator().manual_seed(1))
    windows = next(TargetSamples(teacher, iter([text]), prefix_len=4, seed=0, greedy_fraction=1.0))
    assert torch.equal(windows[:, :4], text[:, :4])
    with torch.no_grad():
        logits = teacher.train_forward(windows[:, :-1])[0]
    assert torch.equal(windows[:, 4:], logits[:, 3:].argmax(-1))


def test_grown_draft_starts_equal_to_its_source_and_rejects_a_misfit():
    from verispec.train.draft import grow_from

    source, grown = tiny(layers=1, seed=5, std=0.2), tiny(layers=2, seed=6, std=0.2)
    grow_from(grown, source)
    tokens = repeating_batch()[:, :-1]
    with torch.no_grad():
        assert torch.allclose(grown.train_forward(tokens)[0], source.train_forward(tokens)[0], atol=1e-5)
    assert grown.model.layers[1].self_attn.o_proj.weight.abs().sum() == 0
    assert grown.model.layers[1].self_attn.q_proj.weight.abs().sum() > 0  # fresh, not zero: it can learn
    with pytest.raises(ValueError, match="shrink"):
        grow_from(tiny(layers=1), tiny(layers=2))


def test_narrowed_mlps_keep_the_busiest_neurons_and_a_whole_width_copy_is_exact():
    from verispec.train.draft import narrow_mlps

    model = tiny(layers=2, seed=3, std=0.2)
    tokens = repeating_batch()[:, :-1]
    with torch.no_grad():
        full = model.train_forward(tokens)[0]
        assert torch.allclose(narrow_mlps(model, 64, tokens).train_forward(tokens)[0], full, atol=1e-5)
        # Silence neuron 5 of each layer: it carries nothing, so it is the first to go.
        for layer in model.model.layers:
            layer.mlp.down_proj.weight[:, 5] = 0
        narrow = narrow_mlps(model, 63, tokens)
    assert narrow.config.intermediate_size == 63 and model.config.intermediate_size == 64
    kept = narrow.model.layers[0].mlp.gate_proj.weight
    original = model.model.layers[0].mlp.gate_proj.weight
    assert torch.equal(kept, torch.cat([original[:5], original[6:]]))
    with torch.no_grad():  # what neuron 5 did not add is all that changed
        assert torch.allclose(narrow.train_forward(tokens)[0], model.train_forward(tokens)[0], atol=1e-5)
    with pytest.raises(ValueError, match="widen"):
        narrow_mlps(model, 65, tokens)


def test_draft_mix_and_recipe_flags_reach_the_recipe():
    from verispec.train.train import _draft_recipe, _parser

    args = _parser().parse_args(["draft", "--minutes", "1", "--mix", "code=3,chat=6,math=1", "--ce-weight", "0",
                                 "--seed", "7", "--lr", "1e-3", "--layers", "3", "--intermediate", "576",
                                 "--argmax-weight", "0.5"])
    recipe = _draft_recipe(args)
    assert recipe.mix == pytest.approx({"code": 0.3, "chat": 0.6, "math": 0.1})
    assert recipe.ce_weight == 0.0 and recipe.optim.seed == 7 and recipe.optim.lr == 1e-3
    assert recipe.model.num_hidden_layers == 3 and recipe.model.intermediate_size == 576
    assert recipe.argmax_weight == 0.5 and recipe.model.hidden_size == 256
    for bad in (["--mix", "prose=1"], ["--mix", "code=x"], ["--mix", "code=0,chat=0"], ["--ce-weight", "2"],
                ["--intermediate", "0"], ["--argmax-weight", "-1"]):
        with pytest.raises(SystemExit):
            _draft_recipe(_parser().parse_args(["draft", "--minutes", "1", *bad]))


def test_bf16_training_runs_under_autocast_learns_and_keeps_float32_state():
    from verispec.train.loop import BudgetedLoop
    from verispec.train.recipes import OptimConfig

    model, tokens, seen = tiny(), repeating_batch(), []

    def loss_fn(batch, micro_step):
        seen.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))
        loss, scalars = layerskip_loss(model, batch, LayerSkipConfig(max_dropout=0.0), micro_step,
                                       random.Random(0))
        return loss, scalars

    config = OptimConfig(lr=1e-2, warmup_steps=1, accum_steps=1, plan_after_steps=1, log_every=1,
                         precision="bf16")
    history = BudgetedLoop(model, config, minutes=0.03).run(iter(lambda: tokens, None), loss_fn)
    assert history.steps_done >= 20 and set(seen) == {(True, torch.bfloat16)}
    assert history.records[-1]["final_loss"] < 0.3 * history.records[0]["final_loss"]
    assert all(p.dtype == torch.float32 for p in model.parameters())
    seen.clear()
    BudgetedLoop(tiny(), OptimConfig(accum_steps=1, plan_after_steps=1), minutes=0.001).run(
        iter(lambda: tokens, None), loss_fn)
    assert seen and not any(enabled for enabled, _ in seen)  # fp32 (the recipe default) does not autocast


def test_precision_auto_follows_the_cpu_flags_and_target_flags_reach_the_recipe():
    from verispec.train.train import _parser, _target_recipe, cpu_has_bf16_matrix_units

    assert cpu_has_bf16_matrix_units("processor : 0\nflags : fpu sse2 avx2 amx_bf16 amx_tile\n")
    assert cpu_has_bf16_matrix_units("flags\t\t: avx512f avx512_bf16\n")
    assert not cpu_has_bf16_matrix_units("flags : fpu sse2 avx2 fma\n")
    args = _parser().parse_args(["target", "--minutes", "1", "--init", "some/dir", "--seed", "4", "--lr", "2e-3",
                                 "--mix", "code=3,chat=5.5,math=1.5", "--precision", "fp32"])
    recipe = _target_recipe(args)
    assert args.init == "some/dir" and recipe.optim.seed == 4 and recipe.optim.lr == 2e-3
    assert recipe.optim.precision == "fp32" and recipe.mix == pytest.approx({"code": 0.3, "chat": 0.55, "math": 0.15})
    auto = _target_recipe(_parser().parse_args(["target", "--minutes", "1"])).optim.precision
    assert auto == ("bf16" if cpu_has_bf16_matrix_units() else "fp32")


def test_target_init_that_is_missing_or_does_not_fit_is_one_clear_error(tmp_path):
    import logging

    from verispec.loading import DEFAULT_DRAFT
    from verispec.train.train import main

    common = ["--minutes", "0.01", "--run-dir", str(tmp_path / "run"), "--out", str(tmp_path / "out")]
    with pytest.raises(SystemExit, match="no checkpoint there"):
        main(["target", "--init", str(tmp_path / "nowhere"), *common])
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        assert main(["target", "--init", str(DEFAULT_DRAFT), *common]) == 2  # the draft's shapes, not the target's
    finally:
        for handler in root.handlers:
            if handler not in handlers:
                handler.close()
        root.handlers[:], root.level = handlers, level
    assert "does not fit the target recipe" in (tmp_path / "run" / "train.log").read_text()
    assert not (tmp_path / "out").exists()


def test_card_acceptance_pools_prompts_and_brackets_them(tmp_path):
    """The model card's acceptance: pooled over prompts (accepted / proposed, as the engine counts them),
    with a bootstrap interval that brackets the pooled rate; a draft identical to the target accepts all."""
    from verispec.config import SamplingParams, SpecConfig, StopRules
    from verispec.drafters import DraftModelDrafter
    from verispec.engine import SpecEngine
    from verispec.models.llama import load_checkpoint
    from verispec.testing import make_checkpoint
    from verispec.train.card import acceptance_by_workload, render

    target = load_checkpoint(make_checkpoint(tmp_path / "t", 64, hidden=32, layers=2, seed=3, via_transformers=False))
    draft = load_checkpoint(make_checkpoint(tmp_path / "d", 64, hidden=16, layers=1, heads=2, kv_heads=1, seed=4,
                                            via_transformers=False))
    rng = random.Random(0)
    prompts = {"code": [[rng.randrange(1, 64) for _ in range(6)] for _ in range(12)]}
    chain, greedy = SpecConfig(method="chain", gamma=4), SamplingParams(temperature=0.0)

    class Count:
        runs = 0

        def update(self, n):
            self.runs += n

    progress = Count()
    same = acceptance_by_workload(SpecEngine(target, DraftModelDrafter(target)), prompts, chain, greedy, 21, progress)
    assert same["code"]["acceptance_rate"] == 1.0 and same["code"]["acceptance_interval"] == (1.0, 1.0)
    assert same["code"]["committed_per_round"] == 5.0  # 21 tokens: prefill's 1, then 4 rounds of 4 drafts + bonus
    engine = SpecEngine(target, DraftModelDrafter(draft))
    got = acceptance_by_workload(engine, prompts, chain, greedy, 20, progress)["code"]
    assert progress.runs == 24 and got["prompts"] == 12
    runs = [engine.generate(ids, greedy, chain, StopRules(max_tokens=20, ignore_eos=True), seed=seed).stats
            for seed, ids in enumerate(prompts["code"])]
    pooled = sum(s.accepted for s in runs) / sum(s.drafted for s in runs)
    assert got["acceptance_rate"] == pytest.approx(pooled) and 0.0 < pooled < 1.0
    low, high = got["acceptance_interval"]
    assert low < pooled < high
    measured = {"chain_gamma4": {"greedy": {"code": got}, "t1": {"code": got}}, "prompts_per_workload": 12,
                "max_tokens": 20, "early_exit_greedy_gamma4": {}, "unadapted_early_exit_greedy_gamma4": {}}
    assert f"{pooled:.3f} [{low:.3f}-{high:.3f}]" in render(measured)


def test_step_estimate_is_renewed_when_the_first_steps_were_slow():
    """The plan from the first steps (slow here: 60 ms of 'warm-up') undershoots; the renewed estimate
    that sizes the progress bar ends near the steps actually run."""
    import time as clock

    from verispec.train.loop import BudgetedLoop
    from verispec.train.recipes import OptimConfig

    model, tokens = tiny(), repeating_batch()

    def loss_fn(batch, micro_step):
        if micro_step < 2:
            clock.sleep(0.06)
        else:
            clock.sleep(0.005)
        return layerskip_loss(model, batch, LayerSkipConfig(max_dropout=0.0), micro_step, random.Random(0))

    config = OptimConfig(accum_steps=1, plan_after_steps=2, log_every=1)
    history = BudgetedLoop(model, config, minutes=0.012).run(iter(lambda: tokens, None), loss_fn)
    assert history.planned_steps < 0.6 * history.steps_done
    assert abs(history.estimated_steps - history.steps_done) <= max(2, 0.1 * history.steps_done)


def test_no_layerskip_flag_trains_a_plain_baseline_target():
    from verispec.train.recipes import TargetRecipe
    from verispec.train.train import _parser, _target_recipe

    plain = _target_recipe(_parser().parse_args(["target", "--minutes", "1", "--no-layerskip"])).layerskip
    assert plain.max_dropout == 0.0 and plain.exits_per_micro_batch == 0
    assert _target_recipe(_parser().parse_args(["target", "--minutes", "1"])).layerskip == TargetRecipe().layerskip
    model, tokens = tiny(), repeating_batch()
    _, scalars = layerskip_loss(model, tokens, plain, 0, random.Random(0))
    assert scalars["layers_skipped"] == 0.0 and not any(key.startswith("exit") for key in scalars)


def test_train_cli_help_and_bad_budget(capsys):
    from verispec.cli import main as verispec_main

    with pytest.raises(SystemExit) as exit_info:
        verispec_main(["train", "--help"])
    assert exit_info.value.code == 0 and "tokenizer,target,draft" in capsys.readouterr().out
    assert verispec_main(["train", "draft", "--minutes", "0"]) == 2
    assert "--minutes must be > 0" in capsys.readouterr().err
