"""cli_generate.py: ``verispec generate`` on a random byte-level pair: JSON for scripts, the human
stats table, and greedy speculation equal to plain decoding."""

from __future__ import annotations

import json

from verispec.cli import main
from verispec.cli_generate import format_stats


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_generate_json(capsys, byte_pair):
    target, draft = byte_pair
    code, out, _ = run(capsys, "generate", "hello", "--target", str(target), "--draft", str(draft),
                       "--max-tokens", "12", "--ignore-eos", "--json", "--gamma", "3", "--gamma-policy", "fixed")
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


def test_format_stats_lines_up_one_row_per_figure():
    summary = {"generated_tokens": 12, "finish_reason": "length", "tokens_per_s": 41.26, "ttft_ms": 3.04, "rounds": 5,
               "per_position_acceptance": {"conditional": [0.9, 0.5]}, "committed_per_round": 2.4,
               "acceptance_rate": 0.7, "accepted": 7, "drafted": 10, "tree_nodes": 2.0,
               "time_split": {"draft_ms": 10.4, "verify_ms": 20.6}}
    assert format_stats(summary, speculative=True).splitlines() == [
        "generated tokens            12 (length)",
        "tokens/s                    41.3",
        "TTFT ms                     3.0",
        "rounds                      5",
        "committed tokens/round      2.40",
        "draft acceptance rate       0.700 (7/10)",
        "acceptance by position      0.90 0.50 (conditional)",
        "verified draft nodes/round  2.00",
        "time split ms               draft=10 verify=21",
    ]
    plain = format_stats(summary, speculative=False).splitlines()
    assert [line.split("  ")[0] for line in plain] == ["generated tokens", "tokens/s", "TTFT ms", "rounds",
                                                        "time split ms"]
