"""The CLI: JSON output for scripts, human output, and one-line errors with exit status 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from verispec.cli import main
from verispec.testing import make_checkpoint


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_generate_json(capsys, byte_pair):
    target, draft = byte_pair
    code, out, _ = run(capsys, "generate", "hello", "--target", str(target), "--draft", str(draft),
                       "--max-tokens", "12", "--ignore-eos", "--json", "--gamma", "3")
    assert code == 0
    data = json.loads(out)
    assert len(data["tokens"]) == 12 and isinstance(data["text"], str)
    stats = data["stats"]
    for key in ("rounds", "drafted", "accepted", "committed_per_round", "acceptance_rate",
                "per_position_acceptance", "tokens_per_s", "ttft_ms", "time_split"):
        assert key in stats
    assert len(stats["per_position_acceptance"]["conditional"]) == 3


def test_generate_greedy_spec_equals_no_spec(capsys, byte_pair):
    target, draft = byte_pair
    common = ["generate", "abc", "--target", str(target), "--max-tokens", "16", "--ignore-eos", "--json"]
    _, spec_out, _ = run(capsys, *common, "--draft", str(draft))
    _, plain_out, _ = run(capsys, *common, "--no-spec")
    assert json.loads(spec_out)["tokens"] == json.loads(plain_out)["tokens"]


def test_generate_human_output(capsys, byte_pair):
    target, draft = byte_pair
    code, out, _ = run(capsys, "generate", "hi", "--target", str(target), "--draft", str(draft),
                       "--max-tokens", "8", "--temperature", "0.9", "--top-k", "20", "--seed", "3")
    assert code == 0 and "committed tokens/round" in out and "tokens/s" in out


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


def test_demo_runs_the_embedded_pair_and_speculation_is_lossless(capsys):
    """The README's main job, shortened: every prompt's speculative output equals plain decoding."""
    code, out, _ = run(capsys, "demo", "--target", "tiny", "--prompts", "1", "--max-tokens", "8", "--threads", "1", "--json",
                       "--methods", "chain,tree,ngram,self")
    assert code == 0
    data = json.loads(out)
    assert data["embedded_pair"] and len(data["prompts"]) == 3 * 4
    assert {row["method"] for row in data["prompts"]} == {"chain", "tree", "ngram", "self"}
    assert all(row["identical"] for row in data["prompts"])
    code, out, _ = run(capsys, "demo", "--target", "tiny", "--prompts", "1", "--max-tokens", "8", "--threads", "1",
                       "--json", "--methods", "eagle,eagle-tree")
    rows = json.loads(out)["prompts"]
    assert code == 0 and {row["method"] for row in rows} == {"eagle", "eagle-tree"} and all(r["identical"] for r in rows)
    code, _, err = run(capsys, "demo", "--methods", "chain,beam")
    assert code == 2 and "beam" in err
    code, _, err = run(capsys, "demo", "--threads", "-1")
    assert code == 2 and "--threads" in err


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


def test_plan_refuses_a_profile_that_is_not_one(capsys, tmp_path):
    path = tmp_path / "list.json"
    path.write_text("[1, 2]")
    code, _, err = run(capsys, "plan", "--profile", str(path))
    assert code == 2 and "not a verispec profile" in err


def test_demo_without_the_embedded_pair_leaves_the_eagle_methods_out(capsys, monkeypatch):
    """The random stand-in pair has no EAGLE head: the default methods run without it, with a note;
    asking for EAGLE methods only is a one-line error."""
    import verispec.demo as demo

    monkeypatch.setattr(demo, "embedded_pair_available", lambda: False)
    code, out, err = run(capsys, "demo", "--target", "tiny", "--prompts", "1", "--max-tokens", "4", "--threads", "1",
                         "--json")
    assert code == 0 and "EAGLE methods are left out" in err
    assert {row["method"] for row in json.loads(out)["prompts"]} == {"chain", "tree", "ngram"}
    code, _, err = run(capsys, "demo", "--target", "tiny", "--methods", "eagle", "--threads", "1")
    assert code == 2 and "only EAGLE methods" in err
