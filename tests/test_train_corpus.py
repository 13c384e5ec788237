"""The workloads: a stable, disjoint train / held-out split, code prompts cut at the docstring, clear errors."""

from __future__ import annotations

import pytest

from verispec.train import corpus


def test_split_is_stable_and_disjoint():
    ids = [f"doc-{i}" for i in range(3000)]
    heldout = {i for i in ids if corpus.is_heldout(i)}
    assert 0.015 < len(heldout) / len(ids) < 0.05
    assert heldout == {i for i in ids if corpus.is_heldout(i)}  # deterministic
    train, held = corpus.load_workload("math", "train"), corpus.load_workload("math", "heldout")
    assert held and not set(train) & set(held)


def test_code_prompts_stop_at_the_docstring_and_long_code_is_cut_at_a_line():
    source = ('def documented(x):\n    """Double x."""\n    return 2 * x\n\n'
              'def bare(x):\n    return x\n\n'
              'class C:\n    def method(self):\n        """Say hi."""\n        return "hi"\n')
    assert corpus._function_prompts(source) == ['def documented(x):\n    """Double x."""\n',
                                                'def method(self):\n    """Say hi."""\n']
    assert corpus._function_prompts("def broken(:\n") == []
    assert corpus._truncate_at_line("aaa\nbbb\nccc\n", 9) == "aaa\nbbb\n"
    assert corpus._truncate_at_line("short", 9) == "short"
    assert corpus._round_robin([["a1", "a2", "a3"], ["b1"]], 3) == ["a1", "b1", "a2"]


def test_an_unknown_split_or_workload_is_named_in_the_error():
    with pytest.raises(ValueError, match="unknown split 'dev'"):
        corpus.math_problems("dev")
    with pytest.raises(ValueError, match="unknown workload 'prose'"):
        corpus.load_workload("prose", "train")
