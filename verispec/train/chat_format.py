"""The chat format of the embedded default model pair: special tokens, a renderer and its Jinja twin.

Every message is a role tag on its own line, the text, and an end marker::

    >>> render_chat([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    '<|user|>\\nHi<|end|>\\n<|assistant|>\\n'

The corpus renders ShareGPT conversations with `render_chat`; the tokenizer ships `CHAT_TEMPLATE`, which
renders the same string, so `tokenizer.apply_chat_template` produces what the model was trained on.
A chat reply ends with `END_TOKEN`; documents in the training stream are separated by `EOS_TOKEN`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Literal

EOS_TOKEN = "<|endoftext|>"
END_TOKEN = "<|end|>"
ROLE_TOKENS = {"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>"}
# Order fixes the ids: EOS_TOKEN gets id 0.
SPECIAL_TOKENS = (EOS_TOKEN, ROLE_TOKENS["user"], ROLE_TOKENS["assistant"], ROLE_TOKENS["system"], END_TOKEN)

Role = Literal["system", "user", "assistant"]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


def render_message(role: Role, content: str) -> str:
    """One message: ``render_message("user", "Hi") == "<|user|>\\nHi<|end|>\\n"``."""
    if role not in ROLE_TOKENS:
        raise ValueError(f"unknown chat role {role!r}; expected one of {sorted(ROLE_TOKENS)}")
    return f"{ROLE_TOKENS[role]}\n{content}{END_TOKEN}\n"


def render_chat(messages: Iterable[Mapping[str, str]], add_generation_prompt: bool = False) -> str:
    """Render ``[{"role": ..., "content": ...}, ...]`` exactly as `CHAT_TEMPLATE` does."""
    text = "".join(render_message(m["role"], m["content"]) for m in messages)  # type: ignore[arg-type]
    if add_generation_prompt:
        text += f"{ROLE_TOKENS['assistant']}\n"
    return text
