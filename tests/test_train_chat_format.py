"""The embedded pair's chat format: the Python renderer and the Jinja template render the same text."""

from __future__ import annotations

import jinja2
import pytest

from verispec.train.chat_format import CHAT_TEMPLATE, EOS_TOKEN, SPECIAL_TOKENS, render_chat, render_message


def test_render_chat_matches_the_shipped_template():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "2+2?"}]
    assert render_chat(messages[1:3]) == "<|user|>\nHi<|end|>\n<|assistant|>\nHello!<|end|>\n"
    template = jinja2.Environment().from_string(CHAT_TEMPLATE)
    for add_generation_prompt in (False, True):
        assert render_chat(messages, add_generation_prompt) == template.render(
            messages=messages, add_generation_prompt=add_generation_prompt)
    assert render_chat([], add_generation_prompt=True) == "<|assistant|>\n"


def test_special_token_order_and_unknown_roles():
    assert SPECIAL_TOKENS[0] == EOS_TOKEN == "<|endoftext|>"  # id 0 is the end of a document
    assert render_message("system", "x") == "<|system|>\nx<|end|>\n"
    with pytest.raises(ValueError, match="unknown chat role 'tool'"):
        render_message("tool", "x")  # type: ignore[arg-type]
