"""Reading ShareGPT records: a truncated JSON array, speaker mapping, split ids and first prompts."""

from __future__ import annotations

import pytest

from verispec.train.sharegpt import Conversation, ascii_fraction, iter_json_array_records, to_conversation


def test_truncated_array_yields_its_complete_records():
    assert list(iter_json_array_records('[{"a": 1}, {"b": [2, 3]},\n {"c": ')) == [{"a": 1}, {"b": [2, 3]}]
    assert list(iter_json_array_records('[ {"a": 1} ]')) == [{"a": 1}]
    assert list(iter_json_array_records("[]")) == []


def test_records_map_to_conversations_and_render():
    record = {"id": "QWJhYvA_2", "conversations": [
        {"from": "system", "value": "Be kind."}, {"from": "human", "value": " Hi <|endoftext|>"},
        {"from": "gpt", "value": "Hello!"}, {"from": "human", "value": ""}, {"from": "bard", "value": "Bye"}]}
    conversation = to_conversation(record)
    assert conversation == Conversation("QWJhYvA_2", (("system", "Be kind."), ("user", "Hi"),
                                                      ("assistant", "Hello!"), ("assistant", "Bye")))
    assert conversation.source_id == "QWJhYvA" and conversation.opens_with_user
    assert conversation.render_first_prompt() == "<|system|>\nBe kind.<|end|>\n<|user|>\nHi<|end|>\n<|assistant|>\n"
    assert conversation.render().endswith("<|assistant|>\nHello!<|end|>\n<|assistant|>\nBye<|end|>\n")
    assert to_conversation({"id": "x_0", "conversations": [{"from": "human", "value": "Hi"}]}) is None
    assert to_conversation({"id": "x_0", "conversations": [{"from": "robot", "value": "Hi"},
                                                           {"from": "gpt", "value": "Yo"}]}) is None


def test_ascii_fraction():
    assert ascii_fraction("héllo") == pytest.approx(0.8)
    assert ascii_fraction("") == 0.0 and ascii_fraction("abc") == 1.0
