"""The CLI: one-line errors with exit status 2, before any long work. Each command's own output:
test_cli_generate.py, test_cli_plan.py, test_cli_profile.py, test_demo.py."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from verispec.cli import main
from verispec.testing import make_checkpoint


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("extra,message", [
    (["--temperature", "-1"], "temperature must be >= 0"),
    (["--top-p", "0"], "top_p must be in (0, 1]"),
    (["--top-p", "1.5"], "top_p must be in (0, 1]"),
    (["--top-k", "-2"], "top_k must be an integer >= 0"),
    (["--min-p", "2"], "min_p must be in [0, 1]"),
    (["--max-tokens", "0"], "max_tokens must be >= 1"),
    (["--gamma", "0"], "gamma must be in 1..64"),
    (["--max-tokens", "100000"], "exceeds the model's context"),
])
def test_bad_parameters_exit_2_with_one_line(capsys, byte_pair, extra, message):
    target, draft = byte_pair
    code, _, err = run(capsys, "generate", "hi", "--target", str(target), "--draft", str(draft), *extra)
    assert code == 2
    assert message in err and "Traceback" not in err and err.count("\n") == 1


def test_bad_checkpoints_exit_2(capsys, tmp_path, byte_pair):
    target, draft = byte_pair
    code, _, err = run(capsys, "generate", "hi", "--target", str(tmp_path / "nope"), "--draft", str(draft))
    assert code == 2 and "does not exist" in err
    other_vocab = make_checkpoint(tmp_path / "other", 100, hidden=32, layers=1, heads=2, kv_heads=1)
    code, _, err = run(capsys, "generate", "hi", "--target", str(target), "--draft", str(other_vocab))
    assert code == 2 and "vocabulary" in err
    code, _, err = run(capsys, "generate", "hi", "--target", str(target))
    assert code == 2 and "--draft" in err


def test_console_script_reports_errors_without_traceback(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "verispec.cli", "generate", "x", "--target", str(tmp_path),
                           "--draft", str(tmp_path)], capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.startswith("verispec: error:") and "Traceback" not in proc.stderr


def test_draft_vocab_resolution(byte_pair):
    from verispec.errors import VerispecError
    from verispec.loading import EMBEDDED_DRAFT_VOCAB, embedded_pair_available, load_pair, resolve_draft_vocab

    pair = load_pair(*byte_pair)
    assert resolve_draft_vocab(pair, "auto") is None  # not the embedded pair: its ids may not be by frequency
    assert resolve_draft_vocab(pair, "all") is None and resolve_draft_vocab(pair, "300") == 300
    for bad in ("0", "many"):
        with pytest.raises(VerispecError, match="--draft-vocab"):
            resolve_draft_vocab(pair, bad)
    if embedded_pair_available():
        assert resolve_draft_vocab(load_pair("tiny"), "auto") == EMBEDDED_DRAFT_VOCAB
        # Through transformers the draft scores every id: auto keeps it whole rather than refuse.
        assert resolve_draft_vocab(load_pair("tiny", backend="hf"), "auto") is None


@pytest.mark.parametrize("argv, message", [
    (["plan", "--alpha", "0.8", "--draft-ms", "0", "--verify-ms", "0", "--baseline-ms", "0"], "--baseline-ms"),
    (["plan", "--alpha", "0.8", "--draft-ms", "1", "--verify-ms", "1", "--baseline-ms", "1", "--sweep", "100000000"],
     "--sweep"),
    (["profile", "--target", "tiny", "--threads", "-1"], "--threads"),
    (["profile", "--target", "tiny", "--out", "/nonexistent-folder/p.json"], "does not exist"),
    (["serve", "--port", "70000"], "--port"),
    (["generate", "caf\udce9", "--target", "tiny", "--max-tokens", "2"], "not valid UTF-8"),
])
def test_bad_arguments_are_one_line_errors(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    assert code == 2 and message in err and err.count("\n") == 1 and "Traceback" not in err


# ---- bad input everywhere: one line on stderr, exit 2, and before any long work ---------------------------


class LongWork(Exception):
    """Raised by stand-ins for loading and measuring: reaching one means the arguments were accepted."""


def no_long_work(monkeypatch):
    """Make loading a model, measuring and benchmarking raise LongWork."""
    import verispec.bench.run
    import verispec.demo
    import verispec.loading
    import verispec.profile

    def refuse(*args, **kwargs):
        raise LongWork

    for module, name in ((verispec.loading, "load_pair"), (verispec.loading, "load_target_and_tokenizer"),
                         (verispec.profile, "profile"), (verispec.bench.run, "run_bench"),
                         (verispec.demo, "_load_demo_pair")):
        monkeypatch.setattr(module, name, refuse)


def run_to_exit(capsys, *argv):
    """``run``, with argparse's own exits (bad option syntax, --help) as their exit status."""
    try:
        return run(capsys, *argv)
    except SystemExit as exit_info:
        out, err = capsys.readouterr()
        return exit_info.code, out, err


def one_line_error(code, err, message):
    return code == 2 and message in err and err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize("argv, message", [
    (["generate", "hi", "--target", "tiny", "--temperature", "inf"], "temperature must be >= 0 and finite"),
    (["generate", "hi", "--target", "tiny", "--temperature", "nan"], "temperature must be >= 0 and finite"),
    (["generate", "hi", "--target", "tiny", "--temperature", "hot"], "invalid float value"),
    (["generate", "\udcff", "--target", "tiny"], "not valid UTF-8"),
    (["serve", "--port", "-1"], "--port must be in 0..65535"),
    (["serve", "--port", "70000"], "--port must be in 0..65535"),
    (["plan", "--alpha", "0.8", "--draft-ms", "inf", "--verify-ms", "1", "--baseline-ms", "1"], "--draft-ms"),
    (["plan", "--alpha", "0.8", "--draft-ms", "1", "--verify-ms", "nan", "--baseline-ms", "1"], "--verify-ms"),
    (["plan", "--alpha", "0.8", "--draft-ms", "1", "--verify-ms", "1", "--baseline-ms", "1", "--gamma", "100000000"],
     "--gamma must be in 0..64"),
    (["plan", "--alpha", "0.8", "--draft-ms", "1", "--verify-ms", "1", "--baseline-ms", "1", "--sweep", "65"],
     "--sweep must be in 1..64"),
    (["plan", "--alpha", "0.8", "--draft-ms", "1", "--verify-ms", "0", "--state-ms", "1", "--baseline-ms", "1",
      "--emit", "vllm"], "--emit"),
    (["plan", "--alpha", "0.8", "--draft-ms", "1", "--verify-ms", "4", "--verify-slope-ms", "2", "--baseline-ms", "1",
      "--sweep", "4"], "--verify-slope-ms"),
    (["plan", "--frobnicate"], "unrecognized arguments"),
    (["profile", "--target", "tiny", "--threads", "-1"], "--threads must be >= 0"),
    (["profile", "--target", "tiny", "--out", "/nonexistent-folder/p.json"], "does not exist"),
    (["profile", "--target", "tiny", "--calibrate", "-1"], "--calibrate"),
    (["profile", "--target", "tiny", "--calibrate-gamma", "0"], "--calibrate-gamma"),
    (["train", "draft", "--minutes", "-1"], "--minutes must be > 0"),
    (["train", "target", "--minutes", "inf"], "--minutes must be > 0 and finite"),
    (["train", "draft", "--minutes", "1", "--ce-weight", "2"], "--ce-weight"),
    (["train", "target", "--minutes", "1", "--init", "/nonexistent-folder"], "no checkpoint there"),
    (["train", "draft"], "required: --minutes"),
])
def test_bad_input_is_one_line_before_any_long_work(capsys, monkeypatch, argv, message):
    no_long_work(monkeypatch)
    code, _, err = run_to_exit(capsys, *argv)
    assert one_line_error(code, err, message), (code, err)


def test_train_help_exits_0(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--help"])
    assert exit_info.value.code == 0 and "usage: verispec train" in capsys.readouterr().out


@pytest.mark.parametrize("change, message", [
    ({"hidden_size": "32"}, "hidden_size must be a positive integer, got '32'"),
    ({"hidden_size": None}, "hidden_size must be a positive integer"),
    ({"num_hidden_layers": "two"}, "num_hidden_layers must be a positive integer"),
    ({"vocab_size": -5}, "vocab_size must be a positive integer"),
    ({"num_attention_heads": 3, "num_key_value_heads": 1, "head_dim": None},
     "hidden_size (32) must be a multiple of num_attention_heads (3)"),
    ({"num_key_value_heads": 3}, "must be a multiple of num_key_value_heads"),
    ({"rope_theta": "big"}, "rope_theta must be a positive number"),
    ({"eos_token_id": "end"}, "eos_token_id"),
    ({"intermediate_size": 100}, "do not fit its config.json: size mismatch for model.layers.0.mlp"),
    ({"num_key_value_heads": 1}, "do not fit its config.json: size mismatch for model.layers.0.self_attn"),
    ({"hidden_size": 64, "head_dim": 16}, "do not fit its config.json: size mismatch"),
])
def test_checkpoint_config_that_does_not_fit_the_weights_is_one_line(capsys, tmp_path, change, message):
    from verispec.testing import make_byte_tokenizer

    vocab = make_byte_tokenizer(tmp_path)
    make_checkpoint(tmp_path, vocab, hidden=32, layers=1, heads=2, kv_heads=2, via_transformers=False)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
    code, _, err = run_to_exit(capsys, "generate", "hi", "--target", str(tmp_path), "--no-spec", "--max-tokens", "2")
    assert one_line_error(code, err, message), err
    code, _, err = run_to_exit(capsys, "generate", "hi", "--target", "tiny", "--draft", str(tmp_path),
                               "--max-tokens", "2")
    assert one_line_error(code, err, message), err


@pytest.mark.parametrize("toml, message", [
    ('[sampling]\ntemperature = "hot"\n', "sampling.temperature must be a number, got 'hot'"),
    ("[sampling]\ntemperature = nan\n", "temperature must be >= 0 and finite"),
    ("[sampling]\ntop_p = 5.0\n", "top_p must be in (0, 1]"),
    ("[prompts]\nmax_output_tokens = 16.5\n", "prompts.max_output_tokens must be an integer, got 16.5"),
    ('[prompts]\nworkloads = "code"\n', "prompts.workloads must be a list of strings, got 'code'"),
    ("[spec]\nvariants = [1, 2]\n", "spec.variants must be a list of strings"),
    ('[spec]\ndraft_vocab = "most"\n', "spec.draft_vocab"),
    ('[offline]\nconcurrency = "1,2"\n', "offline.concurrency must be a list of integers"),
    ('[serving]\nrequest_rates = ["a"]\n', "serving.request_rates must be a list of numbers"),
    ("[models]\nthreads = -1\n", "models.threads must be >= 0"),
    ("[models]\ndraft = 3\n", "models.draft must be a string"),
    ("models = 3\n", "[models] must be a table"),
    ('[[serving.launch]]\nname = "a"\nargs = "x"\n', "serving.launch.args must be a list of strings"),
    ('[[serving.launch]]\nname = "a"\nargs = ["--gamma", "many"]\n', "invalid int value: 'many'"),
    ('[[serving.launch]]\nname = "a"\nargs = ["--max-batch", "0"]\n', "--max-batch must be >= 1"),
    ('[[serving.endpoints]]\nname = "a"\nurl = 3\n', "serving.endpoints.url must be a string"),
])
def test_bench_config_with_bad_values_is_one_line_naming_the_key(capsys, monkeypatch, tmp_path, toml, message):
    no_long_work(monkeypatch)
    path = tmp_path / "bench.toml"
    path.write_text(toml)
    code, _, err = run_to_exit(capsys, "bench", "--config", str(path), "--target", "tiny")
    assert one_line_error(code, err, message), err


def test_bench_config_keeps_good_values(tmp_path):
    """What the stricter checks must still take: "inf" rates, a numeric draft vocabulary, launch args."""
    from verispec.bench.config import load_config

    path = tmp_path / "bench.toml"
    path.write_text('[spec]\ndraft_vocab = 2048\n[serving]\nrequest_rates = [1, "inf"]\n[[serving.launch]]\n'
                    'name = "a"\nargs = ["--method", "chain", "--gamma", "3", "--timeout", "inf"]\n'
                    '[[serving.launch]]\nname = "old"\nargs = ["--option-of-another-version"]\n'
                    'env = { PYTHONPATH = "/tmp/old-checkout" }\n')
    config = load_config(path)
    assert config.spec.draft_vocab == 2048 and config.serving.request_rates == (1, math.inf)
    assert config.serving.launch[0].args == ("--method", "chain", "--gamma", "3", "--timeout", "inf")
    assert config.serving.launch[1].args == ("--option-of-another-version",)  # not checked: another checkout


@pytest.mark.parametrize("change, message", [
    ({"intermediate_size": 100}, "do not fit its config.json: size mismatch"),
    ({"hidden_size": "32"}, "hidden_size must be a positive integer, got '32'"),
    ({"window": 0}, "window must be a positive integer"),
])
def test_compressed_checkpoint_config_that_does_not_fit_is_one_line(capsys, tmp_path, change, message):
    from verispec.testing import make_byte_tokenizer, make_compressed_checkpoint

    vocab = make_byte_tokenizer(tmp_path)
    make_compressed_checkpoint(tmp_path, vocab, hidden=32, layers=1)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
    code, _, err = run_to_exit(capsys, "generate", "hi", "--target", str(tmp_path), "--no-spec", "--max-tokens", "2")
    assert one_line_error(code, err, message), err
