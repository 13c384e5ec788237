"""The three workloads of the default model pair (chat, code, math) with a fixed train / held-out split.

Each workload is a list of documents (strings). Documents are split by a stable id: a document is
held out iff ``sha256(id) % 100 < HELDOUT_PERCENT``; nothing held out is ever trained on.

    >>> docs = load_workload("math", "heldout")     # ~3% of MATH_NUM_PROBLEMS synthetic problems
    >>> heldout_prompts("math", 1)[0].endswith("Answer:")
    True

- ``chat``: ShareGPT conversations (mostly-ASCII ones), ids grouped by source conversation.
- ``code``: the Python standard library's own source files (no tests), id = path inside the stdlib.
- ``math``: synthetic arithmetic word problems (`synthetic_math`), id = problem index. Synthetic.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import logging
import sysconfig
import textwrap
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Literal

from verispec.train import sharegpt, synthetic_math

logger = logging.getLogger(__name__)

Workload = Literal["chat", "code", "math"]
Split = Literal["train", "heldout"]
WORKLOADS: tuple[Workload, ...] = ("chat", "code", "math")
SYNTHETIC_WORKLOADS = frozenset({"math"})

# (messages as (role, text) pairs, add_generation_prompt) -> text; None: the embedded pair's chat format
ChatRenderer = Callable[[Sequence[tuple[str, str]], bool], str]

HELDOUT_PERCENT = 3
CODE_MAX_CHARS = 20_000
CODE_EXCLUDED_DIRS = frozenset({"test", "tests", "idlelib", "site-packages", "__pycache__"})
MATH_NUM_PROBLEMS = 60_000
MATH_SEED = 0
PROMPT_MAX_CHARS = 2_000


def is_heldout(document_id: str) -> bool:
    """Stable across runs and machines (unlike ``hash``): ``is_heldout("x")`` never changes."""
    digest = hashlib.sha256(document_id.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % 100 < HELDOUT_PERCENT


def _keep(document_id: str, split: Split) -> bool:
    if split not in ("train", "heldout"):
        raise ValueError(f"unknown split {split!r}; expected 'train' or 'heldout'")
    return is_heldout(document_id) == (split == "heldout")


@functools.lru_cache(maxsize=1)
def _all_conversations() -> tuple[tuple[sharegpt.Conversation, ...], dict]:
    conversations, counts = sharegpt.read_conversations()
    return tuple(conversations), counts


def chat_conversations(split: Split) -> list[sharegpt.Conversation]:
    return [c for c in _all_conversations()[0] if _keep(c.source_id, split)]


@functools.lru_cache(maxsize=1)
def _stdlib_sources() -> tuple[tuple[str, str], ...]:
    """(path inside the stdlib, full source) for every non-test stdlib module, sorted by path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    sources = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        if CODE_EXCLUDED_DIRS.intersection(relative.parts[:-1]):
            continue
        sources.append((relative.as_posix(), path.read_text(encoding="utf-8", errors="replace")))
    return tuple(sources)


def code_sources(split: Split) -> list[tuple[str, str]]:
    return [(path, source) for path, source in _stdlib_sources() if _keep(path, split)]


def _truncate_at_line(text: str, max_chars: int) -> str:
    if len(text) <= max_chars:
        return text
    cut = text.rfind("\n", 0, max_chars)
    return text[: cut + 1 if cut > 0 else max_chars]


def math_problems(split: Split) -> list[str]:
    """Split by problem index; templated problems can repeat, so a held-out problem whose exact text
    also occurs in the train split is dropped from held-out (nothing held out is ever trained on)."""
    chosen = [synthetic_math.make_problem(i, MATH_SEED) for i in range(MATH_NUM_PROBLEMS)
              if _keep(f"math-{i}", split)]
    if split == "heldout":
        trained = set(math_problems("train"))
        chosen = [problem for problem in chosen if problem not in trained]
    return chosen


def load_workload(name: Workload, split: Split, render_chat: ChatRenderer | None = None) -> list[str]:
    """The documents of one workload and split, in a fixed order. ``render_chat`` renders chats in a
    model's own template (default: the embedded pair's format)."""
    if name == "chat":
        if render_chat is not None:
            return [render_chat(c.messages, False) for c in chat_conversations(split)]
        return [c.render() for c in chat_conversations(split)]
    if name == "code":
        return [_truncate_at_line(source, CODE_MAX_CHARS) for _, source in code_sources(split)]
    if name == "math":
        return math_problems(split)
    raise ValueError(f"unknown workload {name!r}; expected one of {WORKLOADS}")


def _function_prompts(source: str) -> list[str]:
    """Each documented function of a file as its ``def`` line(s) and docstring, dedented, body cut off.

    >>> print(_function_prompts('def f(x):\\n    \"\"\"Double x.\"\"\"\\n    return 2 * x\\n')[0])
    def f(x):
        \"\"\"Double x.\"\"\"
    <BLANKLINE>
    """
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    lines = source.splitlines(keepends=True)
    prompts = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or len(node.body) < 2:
            continue
        if ast.get_docstring(node) is None:
            continue
        docstring_end = node.body[0].end_lineno
        prompt = textwrap.dedent("".join(lines[node.lineno - 1: docstring_end]))
        if len(prompt) <= PROMPT_MAX_CHARS:
            prompts.append(prompt)
    return prompts


def _round_robin(groups: list[list[str]], n: int) -> list[str]:
    picked: list[str] = []
    for depth in range(max((len(g) for g in groups), default=0)):
        picked.extend(g[depth] for g in groups if depth < len(g))
    return picked[:n]


def heldout_prompts(name: Workload, n: int, render_chat: ChatRenderer | None = None) -> list[str]:
    """``n`` deterministic prompts cut from held-out documents (fewer if the workload has fewer).

    chat: the conversation up to and including the first ``<|assistant|>\\n``;
    code: a documented function's signature and docstring, up to the start of its body;
    math: the question up to and including ``Answer:``.
    """
    if name == "chat":
        prompts = (c.render_first_prompt() if render_chat is None else render_chat(c.first_prompt_messages, True)
                   for c in chat_conversations("heldout") if c.opens_with_user)
        return [p for p in prompts if len(p) <= PROMPT_MAX_CHARS][:n]
    if name == "code":
        return _round_robin([_function_prompts(source) for _, source in code_sources("heldout")], n)
    if name == "math":
        return [synthetic_math.question_prompt(p) for p in math_problems("heldout")[:n]]
    raise ValueError(f"unknown workload {name!r}; expected one of {WORKLOADS}")


def chat_filter_counts() -> dict:
    """How many ShareGPT records were decoded, usable, and kept by the ASCII filter."""
    return dict(_all_conversations()[1])


def iter_documents_forever(name: Workload, split: Split, seed: int,
                           render_chat: ChatRenderer | None = None) -> Iterator[tuple[int, str]]:
    """(epoch, document) pairs: the split reshuffled each epoch with ``seed`` and the epoch number."""
    import random

    documents = load_workload(name, split, render_chat)
    if not documents:
        raise ValueError(f"workload {name!r} has no {split} documents")
    epoch = 0
    while True:
        order = list(range(len(documents)))
        random.Random(f"{seed}-{name}-{epoch}").shuffle(order)
        for index in order:
            yield epoch, documents[index]
        epoch += 1
