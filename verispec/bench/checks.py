"""Task checks: math accuracy, code format validity, completion. Pure functions over text.

    >>> math_answer(" 41 - 13 = 28. The answer is 28.")
    '28'
    >>> code_valid("def f(x):\\n    'Double x.'\\n", "    return 2 * x\\nprint(f(2))\\n")
    True
"""

from __future__ import annotations

import ast
import re

ANSWER = re.compile(r"The answer is\s*(-?\d[\d,]*)")


def math_answer(text: str) -> str | None:
    """The first "The answer is N" number in the text (commas dropped), or None."""
    match = ANSWER.search(text)
    return match.group(1).replace(",", "") if match else None


def math_correct(text: str, reference: str) -> bool:
    return math_answer(text) == reference


def code_body(generated: str) -> str:
    """The generated text up to the first non-blank line that is not indented (the function's end)."""
    lines = generated.splitlines(keepends=True)
    body = []
    for line in lines:
        if line.strip() and not line[0].isspace():
            break
        body.append(line)
    return "".join(body)


def code_valid(prompt: str, generated: str) -> bool:
    """Valid iff the body (trimmed at the first dedent) is not blank and prompt + body parses.
    A docstring alone would parse; it is not a body, so a blank body is invalid."""
    body = code_body(generated)
    if not body.strip():
        return False
    try:
        ast.parse(prompt + body)
    except (SyntaxError, ValueError):
        return False
    return True


def check(task: str, prompt_text: str, output_text: str, reference: str | None) -> dict:
    """``{"correct": bool}`` for math, ``{"valid": bool}`` for code, ``{}`` otherwise."""
    if task == "math" and reference is not None:
        return {"correct": math_correct(output_text, reference)}
    if task == "code":
        return {"valid": code_valid(prompt_text, output_text)}
    return {}
