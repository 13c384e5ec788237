"""stopping.py: which emitted tokens a request keeps (max_tokens, EOS, stop strings) and why it ends."""

from __future__ import annotations

import dataclasses

import pytest

from verispec.config import StopRules
from verispec.stopping import StopCut, apply_stop_rules

PIECES = {1: "he", 2: "llo", 3: " wor", 4: "ld", 5: "!"}


def decode(ids: list[int]) -> str:
    return "".join(PIECES[i] for i in ids)


def test_the_docstring_example_keeps_eos_and_drops_what_follows():
    cut = apply_stop_rules([5, 0, 7], generated=[1, 2], stop=StopRules(max_tokens=10, eos_ids=(0,)))
    assert cut == StopCut([5, 0], "stop", None)


def test_tokens_within_every_limit_are_all_kept_and_the_request_goes_on():
    cut = apply_stop_rules([3, 4], generated=[1], stop=StopRules(max_tokens=10, eos_ids=(0,)))
    assert cut == StopCut([3, 4], None, None)


def test_max_tokens_counts_the_tokens_generated_before():
    cut = apply_stop_rules([1, 2, 3, 4], generated=[9], stop=StopRules(max_tokens=3))
    assert cut == StopCut([1, 2], "length", None)
    exact = apply_stop_rules([1, 2], generated=[9], stop=StopRules(max_tokens=3))  # reaches the limit exactly
    assert exact == StopCut([1, 2], "length", None)


def test_only_the_first_eos_ends_the_request():
    cut = apply_stop_rules([4, 2, 6, 2, 6], generated=[], stop=StopRules(max_tokens=10, eos_ids=(6, 7)))
    assert cut.kept == [4, 2, 6] and cut.finish_reason == "stop"
    second_id = apply_stop_rules([4, 7, 6], generated=[], stop=StopRules(max_tokens=10, eos_ids=(6, 7)))
    assert second_id.kept == [4, 7]


def test_eos_on_the_last_allowed_token_is_a_stop_not_a_length():
    cut = apply_stop_rules([3, 0, 5], generated=[1], stop=StopRules(max_tokens=3, eos_ids=(0,)))
    assert cut == StopCut([3, 0], "stop", None)


def test_eos_past_max_tokens_is_never_seen():
    cut = apply_stop_rules([3, 4, 0], generated=[], stop=StopRules(max_tokens=2, eos_ids=(0,)))
    assert cut == StopCut([3, 4], "length", None)


def test_ignore_eos_keeps_eos_tokens_as_ordinary_output():
    stop = StopRules(max_tokens=10, eos_ids=(0,), ignore_eos=True)
    assert apply_stop_rules([5, 0, 7], generated=[], stop=stop) == StopCut([5, 0, 7], None, None)
    limited = dataclasses.replace(stop, max_tokens=2)
    assert apply_stop_rules([5, 0, 7], generated=[], stop=limited) == StopCut([5, 0], "length", None)


def test_a_stop_string_cuts_at_the_token_that_completes_it():
    # "he" + "llo" + " wor": "o w" is complete only with the third piece; its text starts at index 4.
    cut = apply_stop_rules([2, 3, 4], generated=[1], stop=StopRules(max_tokens=10, stop_strings=("o w",)),
                           decode=decode)
    assert cut == StopCut([2, 3], "stop", 4)
    assert decode([1, 2, 3])[:cut.stop_text_index] == "hell"


def test_a_stop_string_may_span_the_generated_boundary():
    cut = apply_stop_rules([2, 3], generated=[1], stop=StopRules(max_tokens=10, stop_strings=("el",)), decode=decode)
    assert cut == StopCut([2], "stop", 1)


def test_the_earliest_stop_string_in_the_text_gives_the_index():
    stop = StopRules(max_tokens=10, stop_strings=("wor", "o w", "zzz"))
    cut = apply_stop_rules([2, 3, 4], generated=[1], stop=stop, decode=decode)
    assert cut == StopCut([2, 3], "stop", 4)


def test_stop_strings_need_a_decoder():
    stop = StopRules(max_tokens=10, stop_strings=("llo",))
    assert apply_stop_rules([2, 3], generated=[1], stop=stop) == StopCut([2, 3], None, None)


def test_stop_strings_are_searched_only_in_what_eos_and_max_tokens_kept():
    after_eos = StopRules(max_tokens=10, eos_ids=(3,), stop_strings=("ld",))
    assert apply_stop_rules([2, 3, 4], generated=[1], stop=after_eos, decode=decode) == StopCut([2, 3], "stop", None)
    after_length = StopRules(max_tokens=2, stop_strings=("ld",))
    cut = apply_stop_rules([2, 3, 4], generated=[], stop=after_length, decode=decode)
    assert cut == StopCut([2, 3], "length", None)


def test_a_stop_cut_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        StopCut([1], None).finish_reason = "stop"
