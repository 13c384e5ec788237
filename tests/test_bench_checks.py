"""verispec.bench.checks: the math-answer and code-validity task checks."""

from __future__ import annotations

from verispec.bench.checks import check, code_body, code_valid, math_answer, math_correct


def test_math_checker():
    assert math_answer(" 41 - 13 = 28. The answer is 28.") == "28"
    assert math_correct(" 3 * 4 = 12. The answer is 12.\nQuestion:", "12")
    assert not math_correct(" 3 * 4 = 12. The answer is 13.", "12")
    assert not math_correct(" 12", "12")  # no final answer stated
    assert math_answer("The answer is 1,200.") == "1200"


def test_code_checker():
    prompt = 'def double(x):\n    """Double x."""\n'
    assert code_valid(prompt, "    return 2 * x\n\nprint(double(2))\n")  # trimmed at the dedent
    assert code_body("    y = 1\n\n    return y\nz = 2\n") == "    y = 1\n\n    return y\n"
    assert not code_valid(prompt, "    return (2 *\n")  # cut mid-expression
    assert not code_valid(prompt, "\n\n")  # a docstring alone is not a body
    assert not code_valid(prompt, "return x\n")  # not indented: no body at all


def test_check_dispatches_by_task():
    assert check("math", "Q", " The answer is 7.", "7") == {"correct": True}
    assert check("math", "Q", " The answer is 8.", "7") == {"correct": False}
    assert check("math", "Q", " The answer is 7.", None) == {}  # no reference: nothing to score
    assert check("code", "def f():\n", "    return 1\n", None) == {"valid": True}
    assert check("sharegpt", "hi", "anything", None) == {}
