"""Training entry points: the shipped model files, draft construction (target samples, growing and
narrowing a draft) and the `verispec train` CLI's flags and errors. The library modules of verispec/train each
have a tests/test_train_<module>.py."""

from __future__ import annotations

import random

import pytest
import torch
from train_helpers import repeating_batch, tiny

from verispec.loading import DATA_DIR
from verispec.models.llama import LlamaConfig, LlamaForCausalLM
from verispec.train.losses import layerskip_loss
from verispec.train.target import init_weights


def test_shipped_model_files_fit_the_size_limit():
    """Issue 3: every committed model file (both checkpoint dirs, tokenizers included) in at most 40 MB."""
    files = [f for name in ("target", "draft") for f in (DATA_DIR / name).iterdir() if f.is_file()]
    assert {f.name for f in files} >= {"config.json", "model.safetensors", "tokenizer.json"}
    assert sum(f.stat().st_size for f in files) <= 40_000_000


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


def test_eagle_flags_reach_its_recipe():
    from verispec.train.train import _eagle_recipe, _parser, cpu_has_bf16_matrix_units

    args = _parser().parse_args(["eagle", "--minutes", "1", "--seed", "7", "--lr", "3e-4", "--precision", "bf16",
                                 "--draft-vocab", "4096", "--unroll", "3"])
    recipe = _eagle_recipe(args)
    assert (recipe.optim.seed, recipe.optim.lr, recipe.optim.precision) == (7, 3e-4, "bf16")
    assert (recipe.draft_vocab, recipe.unroll) == (4096, 3)
    tiny = _eagle_recipe(_parser().parse_args(["eagle", "--target", "tiny", "--minutes", "1"]))
    assert tiny.draft_vocab == 2048 and tiny.optim.precision == ("bf16" if cpu_has_bf16_matrix_units() else "fp32")


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
