"""verispec.server.text: token ids -> text for whole responses and streamed deltas."""

from __future__ import annotations

from verispec.server.text import StreamText, final_text


def test_stream_text_holds_back_what_may_change():
    text = StreamText(lambda ids: "".join(map(chr, ids)), stop_strings=("lo!",))
    assert text.add([ord(c) for c in "Hel"]) == "He"  # "l" may start "lo!"
    assert text.add([ord("p")]) == "lp"
    assert text.add([0xFFFD]) == ""  # an incomplete character
    assert text.finish([ord("l"), ord("o"), ord("!")], stop_text_index=5) == "\ufffd"  # "Help\ufffd|lo!"
    assert text.sent == "Help\ufffd"


def test_final_text_cuts_at_the_stop_index_only_when_there_is_one():
    assert final_text("Hello!", None) == "Hello!"
    assert final_text("Hello!", 3) == "Hel"
    assert final_text("Hello!", 0) == ""


def test_text_a_tokenizer_rewrites_is_never_sent_again():
    """A decode whose earlier text changes (a tokenizer merging across pieces): what was sent stays sent,
    and nothing that contradicts it follows."""
    pieces = {1: "ab", 2: "c", 3: "d"}
    rewritten = {(1, 2): "xyz"}  # "ab" + "c" decodes as "xyz"

    def decode(ids):
        return rewritten.get(tuple(ids[:2]), "".join(pieces[i] for i in ids[:2])) + "".join(pieces[i] for i in ids[2:])

    text = StreamText(decode)
    assert text.add([1]) == "ab"
    assert text.add([2]) == ""  # "xyz" does not start with "ab"
    assert text.add([3]) == ""
    assert text.sent == "ab"
