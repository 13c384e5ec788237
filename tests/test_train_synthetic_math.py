"""Synthetic math problems are arithmetic truth."""

from __future__ import annotations

import re

from verispec.train.synthetic_math import make_problem


def test_synthetic_math_answers_are_correct():
    """Every step 'a op b = c' in the worked answer is arithmetic truth, and the final answer is c."""
    for index in range(300):
        problem = make_problem(index)
        steps = re.findall(r"(\d+) ([-+*/]) (\d+) = (\d+)", problem)
        assert steps, problem
        for a, op, b, c in steps:
            assert eval(f"{a} {op} {b}") == int(c), problem
        assert problem.endswith(f"The answer is {steps[-1][3]}.")


def test_problems_are_reproducible_per_seed_and_the_prompt_ends_at_the_answer_marker():
    from verispec.train.synthetic_math import question_prompt

    assert make_problem(7) == make_problem(7, seed=0) != make_problem(7, seed=1)
    problem = make_problem(7)
    prompt = question_prompt(problem)
    assert prompt.startswith("Question: ") and prompt.endswith("\nAnswer:")
    assert problem.startswith(prompt) and "Answer:" not in problem[len(prompt):]
