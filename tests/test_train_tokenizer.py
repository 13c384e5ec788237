"""The shipped tokenizer (byte-level round trip, EOS id 0, the chat template) and its compact saving."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from verispec.loading import DATA_DIR
from verispec.train.chat_format import render_chat


def test_shipped_tokenizer_loads_with_chat_template():
    tokenizer = AutoTokenizer.from_pretrained(str(DATA_DIR / "target"))
    assert len(tokenizer) == 8192 and tokenizer.eos_token == "<|endoftext|>" and tokenizer.eos_token_id == 0
    text = "def add(a, b):\n    return a + b  # ünïcode ok\n"
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text
    messages = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == render_chat(messages, add_generation_prompt=True)


def test_compacted_tokenizer_json_is_the_same_tokenizer_in_fewer_bytes(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from verispec.train.tokenizer import compact_tokenizer_json

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.train_from_iterator(["def f(x):\n    return x + 1\n"] * 20,
                                  trainer=trainers.BpeTrainer(vocab_size=300, show_progress=False))
    path = tmp_path / "tokenizer.json"
    tokenizer.save(str(path), pretty=True)
    pretty_size = path.stat().st_size
    compact_tokenizer_json(path)
    assert path.stat().st_size < 0.8 * pretty_size
    assert Tokenizer.from_file(str(path)).to_str() == tokenizer.to_str()


def test_batch_encoder_adds_no_special_tokens_and_a_missing_tokenizer_says_what_to_run(tmp_path):
    from verispec.train.tokenizer import batch_encoder, load_tokenizer

    tokenizer = load_tokenizer(DATA_DIR / "target")
    encoded = batch_encoder(tokenizer)(["def f():", "", "<|user|>"])
    assert [tokenizer.decode(ids) for ids in encoded[:2]] == ["def f():", ""] and encoded[1] == []
    assert encoded[2] == [1]  # a special token in the text is that token (id 1: SPECIAL_TOKENS order)
    with pytest.raises(FileNotFoundError, match="run `verispec train tokenizer` first"):
        load_tokenizer(tmp_path)
