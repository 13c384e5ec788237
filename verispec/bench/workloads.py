"""The prompt set: built once per run and given, unchanged, to every variant and every endpoint.

- ``sharegpt``: ShareGPT conversations (the packaged dataset's held-out split, or any ShareGPT-format
  JSON file), sampled as vLLM's serving benchmark does: shuffle with a fixed seed, take the first user
  turn as the prompt and the first reply's token count as the output length (capped), skip prompts or
  references that are too short or too long.
- ``code``: a documented function's signature and docstring from the held-out stdlib split; the model
  writes the body. Checked for format validity (``checks.code_valid``).
- ``math``: held-out synthetic word problems ending in ``Answer:``; the reference answer is the number in
  "The answer is N." Checked for accuracy (``checks.math_correct``).

    prompts = build_prompt_set(config.prompts, tokenizer, max_context=1024, extra_slots=6)
    summary = describe_prompt_set(prompts)   # sha256, input-length distribution per task
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from dataclasses import dataclass
from pathlib import Path

from verispec.bench.config import PromptSettings
from verispec.errors import VerispecError
from verispec.stats import percentile
from verispec.train.chat_format import END_TOKEN  # a chat reply's end, as the server also stops at

CODE_STOPS = ("\ndef ", "\nclass ", "\nif __name__", "\nprint(")  # a new top-level statement (OpenAI allows 4)
MATH_STOPS = ("\n",)  # the worked answer is one line
ANSWER = re.compile(r"The answer is (-?\d+)\.")


@dataclass(frozen=True)
class BenchPrompt:
    prompt_id: str  # "sharegpt-0", "code-3", "math-1"
    task: str  # sharegpt | code | math
    text: str  # the user message (chat template) or the text to complete (raw)
    template: str  # raw | chat
    prompt_ids: tuple[int, ...]
    max_tokens: int
    stop_strings: tuple[str, ...] = ()
    reference: str | None = None  # math: the expected final number
    reference_tokens: int | None = None  # sharegpt: length of the reference reply

    @property
    def messages(self) -> list[dict]:
        return [{"role": "user", "content": self.text}]


def build_prompt_set(settings: PromptSettings, tokenizer, max_context: int, extra_slots: int = 0) -> list[BenchPrompt]:
    """``settings.per_workload`` prompts of each workload that fit ``max_context`` with room for the
    output and ``extra_slots`` (drafts in flight). Raises if a workload yields none."""
    encoder = _Encoder(tokenizer, settings)
    prompts: list[BenchPrompt] = []
    for task in settings.workloads:
        make = {"sharegpt": _sharegpt, "code": _code, "math": _math}[task]
        chosen = make(settings, encoder, max_context - extra_slots)
        if not chosen:
            raise VerispecError(f"workload {task!r} gave no prompt within the length limits (input "
                                f"{settings.min_input_tokens}..{settings.max_input_tokens} tokens, context "
                                f"{max_context}); widen prompts.max_input_tokens or lower max_output_tokens")
        prompts += chosen
    return prompts


def describe_prompt_set(prompts: list[BenchPrompt]) -> dict:
    """Identity (sha256 over ids, limits and stops) and input/output-limit distribution per task."""
    digest = hashlib.sha256()
    for p in prompts:
        digest.update(json.dumps([p.prompt_id, list(p.prompt_ids), p.max_tokens, list(p.stop_strings)]).encode())
    by_task = {}
    for task in dict.fromkeys(p.task for p in prompts):
        group = [p for p in prompts if p.task == task]
        by_task[task] = {
            "prompts": len(group),
            "template": group[0].template,
            "input_tokens": distribution([len(p.prompt_ids) for p in group]),
            "max_tokens": distribution([p.max_tokens for p in group]),
            "stop_strings": list(group[0].stop_strings),
        }
    return {"sha256": digest.hexdigest(), "count": len(prompts), "by_task": by_task,
            "prompts": [{"prompt_id": p.prompt_id, "task": p.task, "template": p.template,
                         "input_tokens": len(p.prompt_ids), "max_tokens": p.max_tokens, "reference": p.reference,
                         "reference_tokens": p.reference_tokens, "text": p.text} for p in prompts]}


def distribution(values: list[float]) -> dict:
    if not values:
        return {"n": 0}
    return {"n": len(values), "min": min(values), "median": percentile(values, 50), "mean": sum(values) / len(values),
            "p95": percentile(values, 95), "max": max(values)}


# ---- the three workloads --------------------------------------------------------------------------------


class _Encoder:
    def __init__(self, tokenizer, settings: PromptSettings):
        self.tokenizer, self.settings = tokenizer, settings
        self.has_chat_template = bool(getattr(tokenizer, "chat_template", None))

    def template_for(self, task: str) -> str:
        if self.settings.template != "auto":
            return self.settings.template
        return "chat" if task == "sharegpt" and self.has_chat_template else "raw"

    def encode(self, text: str, template: str) -> list[int]:
        from verispec.loading import encode_prompt

        if template == "chat" and not self.has_chat_template:
            raise VerispecError("prompts.template is 'chat' but the tokenizer has no chat template; use raw")
        return encode_prompt(self.tokenizer, text, chat=template == "chat")

    def fits(self, prompt_ids: list[int], max_tokens: int, room: int) -> bool:
        s = self.settings
        return s.min_input_tokens <= len(prompt_ids) <= s.max_input_tokens and len(prompt_ids) + max_tokens <= room


def _sharegpt(settings: PromptSettings, encoder: _Encoder, room: int) -> list[BenchPrompt]:
    pairs = sharegpt_pairs(settings.sharegpt_path)
    random.Random(settings.seed).shuffle(pairs)
    template = encoder.template_for("sharegpt")
    chosen = []
    for prompt, reply in pairs:
        reference = len(encoder.tokenizer.encode(reply, add_special_tokens=False))
        if reference < settings.min_output_tokens:
            continue
        max_tokens = min(reference, settings.max_output_tokens)
        ids = encoder.encode(prompt, template)
        if not encoder.fits(ids, max_tokens, room):
            continue
        chosen.append(BenchPrompt(f"sharegpt-{len(chosen)}", "sharegpt", prompt, template, tuple(ids), max_tokens,
                                  reference_tokens=reference))
        if len(chosen) == settings.per_workload:
            break
    return chosen


def sharegpt_pairs(path: str | None) -> list[tuple[str, str]]:
    """(first user message, first reply after it) per conversation. ``path`` None: the packaged
    dataset's held-out split (never trained on by the embedded pair); else any ShareGPT-format JSON."""
    from verispec.train import sharegpt

    if path is None:
        from verispec.train.corpus import chat_conversations

        conversations = chat_conversations("heldout")
    else:
        try:
            text = Path(path).expanduser().read_text(encoding="utf-8")
        except OSError as err:
            raise VerispecError(f"cannot read ShareGPT file {path!r}: {err}") from None
        if "[" not in text:
            raise VerispecError(f"{path!r} is not a ShareGPT-format JSON array of conversations")
        records = [r for r in sharegpt.iter_json_array_records(text) if isinstance(r, dict)]
        conversations = [c for c in map(sharegpt.to_conversation, records) if c is not None]
    pairs = []
    for conversation in conversations:
        messages = conversation.messages
        for i, (role, text) in enumerate(messages[:-1]):
            if role == "user":
                if messages[i + 1][0] == "assistant":
                    pairs.append((text, messages[i + 1][1]))
                break
    return pairs


def _code(settings: PromptSettings, encoder: _Encoder, room: int) -> list[BenchPrompt]:
    from verispec.train.corpus import heldout_prompts

    candidates = heldout_prompts("code", 10**9)
    random.Random(settings.seed).shuffle(candidates)
    template, max_tokens = encoder.template_for("code"), settings.max_output_tokens
    chosen = []
    for text in candidates:
        ids = encoder.encode(text, template)
        if encoder.fits(ids, max_tokens, room):
            chosen.append(BenchPrompt(f"code-{len(chosen)}", "code", text, template, tuple(ids), max_tokens,
                                      CODE_STOPS))
            if len(chosen) == settings.per_workload:
                break
    return chosen


def _math(settings: PromptSettings, encoder: _Encoder, room: int) -> list[BenchPrompt]:
    from verispec.train.corpus import math_problems
    from verispec.train.synthetic_math import question_prompt

    problems = math_problems("heldout")
    random.Random(settings.seed).shuffle(problems)
    template, max_tokens = encoder.template_for("math"), settings.max_output_tokens
    chosen = []
    for problem in problems:
        text, answer = question_prompt(problem), ANSWER.search(problem)
        ids = encoder.encode(text, template)
        if answer and encoder.fits(ids, max_tokens, room):
            chosen.append(BenchPrompt(f"math-{len(chosen)}", "math", text, template, tuple(ids), max_tokens,
                                      MATH_STOPS, reference=answer.group(1)))
            if len(chosen) == settings.per_workload:
                break
    return chosen


def eos_for(prompt: BenchPrompt, eos_ids: tuple[int, ...], tokenizer) -> tuple[int, ...]:
    """Chat prompts also stop at the end-of-message token, as the server does."""
    if prompt.template != "chat":
        return eos_ids
    end = tokenizer.get_vocab().get(END_TOKEN)
    return eos_ids + ((end,) if end is not None and end not in eos_ids else ())
