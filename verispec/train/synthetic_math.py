"""Synthetic arithmetic word problems: the `math` workload (no real math data set installs offline).

Problem ``index`` depends only on ``(seed, index)``, so the set is reproducible and can be split by id:

    >>> print(make_problem(0, seed=0))  # doctest: +SKIP
    Question: Ava has 12 pencils and buys 7 more. How many pencils does Ava have now?
    Answer: 12 + 7 = 19. The answer is 19.

Every text is ``Question: ...\\nAnswer: <working>. The answer is <n>.``; `ANSWER_MARKER` separates
the prompt from the solution.
"""

from __future__ import annotations

import random

SYNTHETIC = True  # label carried into every stats file that mentions this workload
ANSWER_MARKER = "Answer:"

NAMES = ("Ava", "Ben", "Chloe", "Dan", "Emma", "Finn", "Grace", "Hugo", "Iris", "Jack", "Kira", "Leo",
         "Maya", "Noah", "Olga", "Paul", "Quinn", "Rosa", "Sam", "Tom", "Uma", "Vik", "Wendy", "Yusuf", "Zoe")
ITEMS = ("apple", "pencil", "marble", "book", "sticker", "cookie", "stamp", "coin", "shell", "card",
         "orange", "balloon", "toy car", "cupcake", "flower")


def _plural(item: str, count: int) -> str:
    return item if count == 1 else item + "s"


def _add(rng: random.Random, name: str, item: str) -> tuple[str, str]:
    a, b = rng.randint(2, 99), rng.randint(2, 99)
    question = rng.choice((
        f"{name} has {a} {_plural(item, a)} and buys {b} more. How many {item}s does {name} have now?",
        f"There are {a} {_plural(item, a)} in a box. {name} puts in {b} more. How many {item}s are in the box?",
        f"{name} collected {a} {_plural(item, a)} on Monday and {b} on Tuesday. How many {item}s in total?",
    ))
    return question, f"{a} + {b} = {a + b}. The answer is {a + b}."


def _subtract(rng: random.Random, name: str, item: str) -> tuple[str, str]:
    a = rng.randint(10, 99)
    b = rng.randint(1, a - 1)
    friend = rng.choice([n for n in NAMES if n != name])
    question = rng.choice((
        f"{name} had {a} {_plural(item, a)} and gave {b} to {friend}. How many {item}s does {name} have left?",
        f"A shop had {a} {_plural(item, a)}. It sold {b} of them. How many {item}s are left?",
        f"{name} has {a} {_plural(item, a)}. {friend} has {b}. How many more {item}s does {name} have?",
    ))
    return question, f"{a} - {b} = {a - b}. The answer is {a - b}."


def _multiply(rng: random.Random, name: str, item: str) -> tuple[str, str]:
    a, b = rng.randint(2, 12), rng.randint(2, 25)
    question = rng.choice((
        f"{name} buys {a} bags. Each bag holds {b} {_plural(item, b)}. How many {item}s does {name} buy?",
        f"There are {a} rows with {b} {_plural(item, b)} in each row. How many {item}s are there?",
    ))
    return question, f"{a} * {b} = {a * b}. The answer is {a * b}."


def _divide(rng: random.Random, name: str, item: str) -> tuple[str, str]:
    share, people = rng.randint(2, 20), rng.randint(2, 10)
    total = share * people
    question = (f"{name} shares {total} {item}s equally among {people} friends. "
                f"How many {item}s does each friend get?")
    return question, f"{total} / {people} = {share}. The answer is {share}."


def _two_step(rng: random.Random, name: str, item: str) -> tuple[str, str]:
    start, bags, per_bag = rng.randint(1, 50), rng.randint(2, 9), rng.randint(2, 12)
    bought = bags * per_bag
    given = rng.randint(1, start + bought - 1)
    left = start + bought - given
    question = (f"{name} has {start} {_plural(item, start)}. {name} buys {bags} packs with {per_bag} "
                f"{item}s each, then gives away {given}. How many {item}s does {name} have now?")
    answer = (f"{bags} * {per_bag} = {bought}. {start} + {bought} = {start + bought}. "
              f"{start + bought} - {given} = {left}. The answer is {left}.")
    return question, answer


TEMPLATES = (_add, _subtract, _multiply, _divide, _two_step)


def make_problem(index: int, seed: int = 0) -> str:
    """The ``index``-th problem of the set ``seed`` as ``"Question: ...\\nAnswer: ..."``."""
    rng = random.Random(f"math-{seed}-{index}")
    template = rng.choice(TEMPLATES)
    question, answer = template(rng, rng.choice(NAMES), rng.choice(ITEMS))
    return f"Question: {question}\n{ANSWER_MARKER} {answer}"


def question_prompt(problem: str) -> str:
    """The problem up to and including ``"Answer:"``, i.e. what a model is asked to complete."""
    return problem[: problem.index(ANSWER_MARKER) + len(ANSWER_MARKER)]
