"""verispec.bench.workloads: ShareGPT pairs from a file, the prompt set's length filters and identity, and the
chat stop token, on a byte-level stand-in tokenizer (the real tokenizer's chat template is exercised by the
ShareGPT test in tests/test_bench.py)."""

from __future__ import annotations

import json

import pytest

from verispec.bench.config import PromptSettings
from verispec.bench.workloads import (BenchPrompt, build_prompt_set, describe_prompt_set, distribution, eos_for,
                                      sharegpt_pairs)
from verispec.errors import VerispecError


class _Bytes:
    """A tokenizer with one id per UTF-8 byte and no chat template; id 300 is the end-of-message token."""

    chat_template = None

    def encode(self, text, add_special_tokens=False):
        return list(text.encode())

    def get_vocab(self):
        return {"<|end|>": 300}


def _sharegpt(tmp_path, pairs) -> str:
    rows = [{"id": str(i), "conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]}
            for i, (q, a) in enumerate(pairs)]
    rows.append({"id": "x", "conversations": [{"from": "human", "value": "unanswered"}]})
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(rows))
    return str(path)


def test_sharegpt_pairs_take_the_first_question_and_its_reply(tmp_path):
    path = _sharegpt(tmp_path, [("Q1", "A1"), ("Q2", "A2")])
    assert sharegpt_pairs(path) == [("Q1", "A1"), ("Q2", "A2")]  # the unanswered record gives no pair
    (tmp_path / "bad.json").write_text('{"id": 1}')
    with pytest.raises(VerispecError, match="is not a ShareGPT-format JSON array"):
        sharegpt_pairs(str(tmp_path / "bad.json"))
    with pytest.raises(VerispecError, match="cannot read ShareGPT file"):
        sharegpt_pairs(str(tmp_path / "missing.json"))


def test_prompt_set_keeps_prompts_within_the_length_limits(tmp_path):
    path = _sharegpt(tmp_path, [("hi?", "a long enough reply"),  # 3 bytes: below min_input_tokens 4
                                ("short reply?", "No."),  # reference below min_output_tokens
                                ("x" * 50, "a long enough reply"),  # above max_input_tokens
                                ("ok, so?", "a reply of thirty bytes, yes.."), ("fine?", "twelve bytes")])
    settings = PromptSettings(workloads=("sharegpt",), per_workload=5, sharegpt_path=path, min_output_tokens=5,
                              max_input_tokens=20, max_output_tokens=16)
    prompts = build_prompt_set(settings, _Bytes(), max_context=512)
    assert sorted((p.text, p.max_tokens, p.reference_tokens) for p in prompts) == [("fine?", 12, 12), ("ok, so?", 16, 30)]
    assert all(p.template == "raw" and p.prompt_ids == tuple(p.text.encode()) for p in prompts)
    assert [p.prompt_id for p in prompts] == ["sharegpt-0", "sharegpt-1"]
    again = build_prompt_set(settings, _Bytes(), max_context=512)
    assert [p.text for p in again] == [p.text for p in prompts]  # the shuffle is seeded
    with pytest.raises(VerispecError, match="workload 'sharegpt' gave no prompt within the length limits"):
        build_prompt_set(settings, _Bytes(), max_context=20, extra_slots=4)  # 5 + 12 > 20 - 4


def test_prompt_set_identity_and_distribution():
    prompts = [BenchPrompt("code-0", "code", "def f():", "raw", (1, 2, 3), 8, ("\ndef ",)),
               BenchPrompt("code-1", "code", "def g():", "raw", (4,), 8, ("\ndef ",))]
    described = describe_prompt_set(prompts)
    assert described["count"] == 2 and described["by_task"]["code"]["input_tokens"]["median"] == 2.0
    assert described["by_task"]["code"]["stop_strings"] == ["\ndef "]
    longer = [prompts[0], BenchPrompt("code-1", "code", "def g():", "raw", (4,), 9, ("\ndef ",))]
    assert describe_prompt_set(longer)["sha256"] != described["sha256"]  # limits are part of the identity
    assert describe_prompt_set(list(prompts))["sha256"] == described["sha256"]
    assert distribution([1, 2, 3, 10]) == {"n": 4, "min": 1, "median": 2.5, "mean": 4.0, "p95": pytest.approx(8.95),
                                           "max": 10}
    assert distribution([]) == {"n": 0}


def test_chat_prompts_also_stop_at_the_end_of_message_token():
    chat = BenchPrompt("s-0", "sharegpt", "hi", "chat", (1,), 4)
    raw = BenchPrompt("s-1", "sharegpt", "hi", "raw", (1,), 4)
    assert eos_for(chat, (2,), _Bytes()) == (2, 300) and eos_for(chat, (300,), _Bytes()) == (300,)
    assert eos_for(raw, (2,), _Bytes()) == (2,)
