"""OpenAI logprobs from ``verispec serve``, exact under speculation.

The oracle is the target alone: the log-softmax of its causal logits over prompt + output
(``train_forward``), at each output token's position. Every method the server runs (a draft model,
a perfect draft, n-gram lookup, an EAGLE head, none) must report those values within 1e-5, for
accepted, recovered and bonus tokens alike, whole or streamed, through the official openai client.
"""

from __future__ import annotations

import contextlib
import json
import random

import pytest
import torch

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from test_server import MODEL, http, serving  # noqa: E402
from verispec.batch import BatchEngine, BatchRequest, TokenLogprob  # noqa: E402
from verispec.config import SamplingParams, SpecConfig, StopRules  # noqa: E402
from verispec.loading import ModelPair, load_pair  # noqa: E402
from verispec.server.app import create_app  # noqa: E402
from verispec.server.logprobs import BYTE_LEVEL, LogprobReport, TokenStrings  # noqa: E402
from verispec.server.scheduler import ServerConfig  # noqa: E402
from verispec.server.text import StreamText  # noqa: E402
from verispec.stopping import apply_stop_rules  # noqa: E402

TOLERANCE = 1e-5
METHODS = ("model", "perfect", "ngram", "none")
SPECS = {"model": SpecConfig(gamma=3), "perfect": SpecConfig(gamma=3), "ngram": SpecConfig(gamma=3, drafter="ngram"),
         "none": SpecConfig(method="none"), "tree": SpecConfig(method="tree", tree="s3_k2_d6"),
         "perfect-tree": SpecConfig(method="tree", tree="s3_k2_d6")}
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]


@pytest.fixture(scope="module")
def pair(byte_pair) -> ModelPair:
    return load_pair(*byte_pair)


@pytest.fixture(scope="module")
def servers(pair):
    """A live server per method; "perfect" drafts with the target itself, so every draft is accepted."""
    perfect = ModelPair(pair.target, pair.target, pair.tokenizer, pair.target_dir, pair.target_dir)
    with contextlib.ExitStack() as stack:
        yield {method: stack.enter_context(serving(create_app(
            perfect if method == "perfect" else pair, SPECS[method], ServerConfig(max_batch=4, timeout_s=60))))
            for method in METHODS}


@pytest.fixture(scope="module")
def strings(pair) -> TokenStrings:
    return TokenStrings(pair.tokenizer)


@pytest.fixture(scope="module")
def ids_of(pair, strings) -> dict[str, int]:
    """Token string -> id: this byte-level vocabulary shows every token differently."""
    table = {strings(token)[0]: token for token in range(len(pair.tokenizer))}
    assert len(table) == len(pair.tokenizer)
    return table


def encode(pair, prompt: str) -> list[int]:
    return list(pair.tokenizer.encode(prompt, add_special_tokens=False))


def chat_prompt(pair) -> list[int]:
    return list(pair.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True,
                                                   return_dict=False))


def target_logprobs(target, prompt_ids: list[int], token_ids: list[int]) -> torch.Tensor:
    """(T, V): the target's own log-softmax at each of ``token_ids``' positions after ``prompt_ids``."""
    with torch.inference_mode():
        logits, _ = target.train_forward(torch.tensor([prompt_ids + token_ids]))
    return torch.log_softmax(logits[0, len(prompt_ids) - 1:-1].float(), dim=-1)


def assert_target_values(pair, strings, ids_of, prompt_ids, tokens, logprobs, tops, top_n):
    """``tokens`` (strings), their ``logprobs`` and ``tops`` (per token: [(string, logprob)], best first)
    are the target's own."""
    token_ids = [ids_of[token] for token in tokens]
    expected = target_logprobs(pair.target, prompt_ids, token_ids)
    chosen = expected[torch.arange(len(token_ids)), torch.tensor(token_ids)]
    assert torch.allclose(torch.tensor(logprobs), chosen, rtol=0, atol=TOLERANCE)
    for row, top in zip(expected, tops):
        best = torch.topk(row, top_n)
        assert [name for name, _ in top] == [strings(t)[0] for t in best.indices.tolist()]
        assert torch.allclose(torch.tensor([value for _, value in top]), best.values, rtol=0, atol=TOLERANCE)


def complete(client, prompt: str = "Hello", max_tokens: int = 24, temperature: float = 0, **options):
    extra = {"ignore_eos": True, "return_spec_stats": True, **options.pop("extra_body", {})}
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=temperature,
                                      seed=3, extra_body=extra, **options)


def chat(client, **options):
    return client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=20, temperature=0,
                                          logprobs=True, **options)


def completion_lists(logprobs) -> tuple:
    return logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, logprobs.text_offset


def chat_lists(content) -> tuple:
    return ([entry.token for entry in content], [entry.logprob for entry in content],
            [[(top.token, top.logprob) for top in entry.top_logprobs] for entry in content])


def assert_lists_close(first: tuple, second: tuple) -> None:
    """Equal lists of strings, offsets and top entries, their logprobs within TOLERANCE."""
    assert len(first) == len(second)
    for a, b in zip(first, second):
        flat_a, flat_b = _flatten(a), _flatten(b)
        assert [v for v in flat_a if not isinstance(v, float)] == [v for v in flat_b if not isinstance(v, float)]
        assert [v for v in flat_a if isinstance(v, float)] == pytest.approx(
            [v for v in flat_b if isinstance(v, float)], abs=TOLERANCE)


def _flatten(value) -> list:
    if isinstance(value, dict):
        return [item for key, logprob in value.items() for item in (key, logprob)]
    if isinstance(value, (list, tuple)):
        return [item for part in value for item in _flatten(part)]
    return [value]


# ---- values ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", METHODS)
def test_completion_logprobs_are_the_targets(pair, servers, strings, ids_of, method):
    """Greedy and sampled, every committed token's logprob and top 5 are the target's own; greedy
    ones are raw (before temperature 0), so not all 0.0."""
    client = servers[method].client()
    for temperature in (0, 1.0):
        result = complete(client, temperature=temperature, logprobs=5)
        logprobs, stats = result.choices[0].logprobs, result.model_extra["spec_stats"]
        assert len(logprobs.tokens) == result.usage.completion_tokens == 24
        assert_target_values(pair, strings, ids_of, encode(pair, "Hello"), logprobs.tokens, logprobs.token_logprobs,
                             [list(top.items()) for top in logprobs.top_logprobs], 5)
        assert logprobs.text_offset[0] == 0 and logprobs.text_offset == sorted(logprobs.text_offset)
        assert max(logprobs.text_offset) <= len(result.choices[0].text)
        if temperature == 0:
            assert all(top[token] == logprob for top, token, logprob
                       in zip(logprobs.top_logprobs, logprobs.tokens, logprobs.token_logprobs))
            assert min(logprobs.token_logprobs) < -1e-3
        if method == "perfect":  # accepted drafts, and a bonus token every round
            assert stats["accepted"] == stats["drafted"] > 0
        if method == "model":  # recovered tokens
            assert stats["drafted"] > stats["accepted"]


@pytest.mark.parametrize("method", ("model", "perfect", "ngram"))
def test_speculation_on_and_off_report_the_same_logprobs(servers, method):
    spec, plain = servers[method].client(), servers["none"].client()
    for prompt in ("Hello", "The quick brown fox"):
        on, off = (complete(client, prompt, 30, logprobs=3).choices[0] for client in (spec, plain))
        assert on.text == off.text
        assert_lists_close(completion_lists(on.logprobs), completion_lists(off.logprobs))
    on, off = (chat(client, top_logprobs=3).choices[0] for client in (spec, plain))
    assert on.message.content == off.message.content
    assert_lists_close(chat_lists(on.logprobs.content), chat_lists(off.logprobs.content))


def test_chat_logprobs_are_the_targets_with_their_bytes(pair, servers, strings, ids_of):
    reply = chat(servers["model"].client(), top_logprobs=4)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens
    tokens, logprobs, tops = chat_lists(content)
    assert_target_values(pair, strings, ids_of, chat_prompt(pair), tokens, logprobs, tops, 4)
    special = set(pair.tokenizer.all_special_tokens)
    text = b"".join(bytes(entry.bytes) for entry in content if entry.token not in special)
    assert text.decode(errors="replace") == reply.choices[0].message.content
    assert all(top.bytes == strings(ids_of[top.token])[1] for entry in content for top in entry.top_logprobs)


def test_top_logprobs_count_and_order(servers):
    client = servers["model"].client()
    none = complete(client, max_tokens=6, logprobs=0).choices[0].logprobs
    assert none.top_logprobs is None and len(none.token_logprobs) == 6
    most = complete(client, max_tokens=6, logprobs=20).choices[0].logprobs
    for top in most.top_logprobs:
        assert len(top) == 20 and list(top.values()) == sorted(top.values(), reverse=True)
    assert all(entry.top_logprobs == [] for entry in chat(client).choices[0].logprobs.content)
    for entry in chat(client, top_logprobs=7).choices[0].logprobs.content:
        values = [top.logprob for top in entry.top_logprobs]
        assert len(values) == 7 and values == sorted(values, reverse=True) and entry.logprob == values[0]
    plain = complete(client, max_tokens=6).choices[0]
    assert plain.logprobs is None


# ---- streaming and stop strings ----------------------------------------------------------------------------


@pytest.mark.parametrize("method", ("model", "none"))
def test_stream_concatenates_to_the_non_streamed_logprobs(servers, method):
    client = servers[method].client()
    for prompt in ("abc", "The quick brown fox"):
        whole = complete(client, prompt, 30, logprobs=2).choices[0]
        chunks = list(complete(client, prompt, 30, logprobs=2, stream=True))
        parts = [completion_lists(c.choices[0].logprobs) for c in chunks if c.choices[0].logprobs]
        assert "".join(c.choices[0].text for c in chunks) == whole.text
        assert_lists_close(tuple(sum(lists, []) for lists in zip(*parts)), completion_lists(whole.logprobs))
    reply = chat(client, top_logprobs=2).choices[0]
    chunks = list(chat(client, top_logprobs=2, stream=True))
    content = [entry for c in chunks if c.choices and c.choices[0].logprobs for entry in c.choices[0].logprobs.content]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reply.message.content
    assert_lists_close(chat_lists(content), chat_lists(reply.logprobs.content))


def test_stop_strings_report_the_tokens_of_the_text_kept(servers):
    """Tokens cut away with a stop string are not reported; tokens held back while they might start one
    are reported later in the stream."""
    client = servers["model"].client()
    full = complete(client, "stop here", 40, logprobs=1).choices[0]
    text = full.text
    start = next(j for j in range(3, len(text) - 2) if "\ufffd" not in text[j:j + 2] and text.find(text[j:j + 2]) > 0)
    stop = text[start:start + 2]
    kept = text[:text.find(stop)]
    result = complete(client, "stop here", 40, logprobs=1, stop=[stop, "never-ever"]).choices[0]
    assert result.text == kept and result.finish_reason == "stop"
    count = len(result.logprobs.tokens)
    assert all(offset < len(kept) for offset in result.logprobs.text_offset)
    assert full.logprobs.text_offset[count] >= len(kept)  # the first token not reported starts in the cut
    prefix = tuple(part[:count] for part in completion_lists(full.logprobs))
    assert_lists_close(completion_lists(result.logprobs), prefix)
    chunks = list(complete(client, "stop here", 40, logprobs=1, stop=stop, stream=True))
    parts = [completion_lists(c.choices[0].logprobs) for c in chunks if c.choices[0].logprobs]
    assert "".join(c.choices[0].text for c in chunks) == kept
    assert_lists_close(tuple(sum(lists, []) for lists in zip(*parts)), completion_lists(result.logprobs))


def test_streamed_reports_concatenate_to_the_whole_one():
    """The reporting rule alone, over random byte outputs with multi-byte characters, stop strings and
    rounds of random sizes, as the engine and the server run it."""
    rng = random.Random(0)
    pieces = [b"a", b"b", b" ", "é".encode(), "—".encode(), "😀".encode()]

    def decode(ids: list[int]) -> str:
        return bytes(ids).decode(errors="replace")

    def report() -> LogprobReport:
        return LogprobReport(decode, lambda token: (chr(token), [token]), chat=False, top_n=0)

    for _ in range(200):
        output = list(b"".join(rng.choice(pieces) for _ in range(rng.randrange(1, 12))))
        stop = StopRules(max_tokens=len(output), stop_strings=tuple(rng.sample(["ab", "é", "b —", "zz"], 2)))
        stream, text, generated, blocks = report(), StreamText(decode, stop.stop_strings), [], []
        while True:
            size = rng.randrange(1, 5)
            cut = apply_stop_rules(output[len(generated):len(generated) + size], generated, stop, decode)
            entries = [TokenLogprob(float(len(generated) + i)) for i in range(len(cut.kept))]
            generated += cut.kept
            if cut.finish_reason:
                text.finish(cut.kept, cut.stop_text_index)
                blocks.append(stream.rest(cut.kept, entries, cut.stop_text_index))
                break
            text.add(cut.kept)
            blocks.append(stream.through(cut.kept, entries, len(text.sent)))
        whole = report().whole(generated, [TokenLogprob(float(i)) for i in range(len(generated))],
                               cut.stop_text_index)
        streamed = [block for block in blocks if block]
        assert [v for block in streamed for v in block["token_logprobs"]] == whole["token_logprobs"]
        assert [v for block in streamed for v in block["text_offset"]] == whole["text_offset"]
        final = text.sent
        assert all(offset < len(final) for offset in whole["text_offset"]) or not final


# ---- the engine, token strings, validation -----------------------------------------------------------------


def test_engine_computes_logprobs_only_for_requests_that_ask(pair):
    engine = BatchEngine(pair.target, pair.draft, SpecConfig(gamma=3), max_batch=2)
    requests = [BatchRequest(name, encode(pair, "Hello"), SamplingParams(temperature=0), StopRules(max_tokens=9),
                             logprobs=asked) for name, asked in (("plain", None), ("asked", 2))]
    events = [event for request in requests for event in engine.add(request)]
    while engine.active:
        events += engine.step()
    for name in ("plain", "asked"):
        mine = [event for event in events if event.request_id == name]
        assert sum(len(event.tokens) for event in mine) == 9
        if name == "plain":
            assert all(event.logprobs is None for event in mine)
        else:
            assert all(len(event.logprobs) == len(event.tokens) for event in mine)
            assert all(len(entry.top_ids) == 2 for event in mine for entry in event.logprobs)


def test_token_strings_show_parts_of_characters_as_bytes(pair, strings):
    byte_token = {byte: char for char, byte in BYTE_LEVEL.items()}
    dash = pair.tokenizer.convert_tokens_to_ids(byte_token[0xE2])
    assert strings(dash) == ("bytes:\\xe2", [0xE2])
    assert strings(pair.tokenizer.convert_tokens_to_ids(byte_token[ord("a")])) == ("a", [97])
    eos = pair.tokenizer.eos_token_id
    assert strings(eos) == (pair.tokenizer.eos_token, list(pair.tokenizer.eos_token.encode()))

    class ByteFallback:  # SentencePiece's raw-byte pieces
        def decode(self, ids, skip_special_tokens):
            return "\ufffd"

        def convert_ids_to_tokens(self, token_id):
            return "<0xC3>"

    assert TokenStrings(ByteFallback())(5) == ("bytes:\\xc3", [0xC3])


@pytest.mark.parametrize("path,body,param", [
    ("completions", {"logprobs": 21}, "logprobs"),
    ("completions", {"logprobs": -1}, "logprobs"),
    ("completions", {"logprobs": 2, "echo": True}, "echo"),
    ("chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat/completions", {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ("chat/completions", {"top_logprobs": 2}, "top_logprobs"),
])
def test_bad_logprobs_get_400_in_openai_format(servers, path, body, param):
    base = {"prompt": "hi"} if path == "completions" else {"messages": [{"role": "user", "content": "hi"}]}
    status, _, text = http(f"{servers['none'].url}/v1/{path}", {"model": MODEL, "max_tokens": 4, **base, **body})
    assert status == 400, text
    error = json.loads(text)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == param and param in error["message"]


def test_eagle_logprobs_are_the_targets(byte_pair, tmp_path, strings, ids_of):
    from test_eagle import frozen_head
    from verispec.models.eagle import save_eagle

    plain_pair = load_pair(*byte_pair)
    save_eagle(frozen_head(plain_pair.target, 64, accelerate=False), tmp_path / "head", "test")
    eagle_pair = load_pair(byte_pair[0], need_draft=False, need_eagle=True, eagle_dir=tmp_path / "head")
    spec = SpecConfig(gamma=3, drafter="eagle")
    with serving(create_app(eagle_pair, spec, ServerConfig(max_batch=2, timeout_s=60))) as live:
        result = complete(live.client(), logprobs=3)
    logprobs = result.choices[0].logprobs
    assert result.model_extra["spec_stats"]["drafted"] > 0
    assert_target_values(plain_pair, strings, ids_of, encode(plain_pair, "Hello"), logprobs.tokens,
                         logprobs.token_logprobs, [list(top.items()) for top in logprobs.top_logprobs], 3)


def _processed_oracle(target, prompt_ids: list[int], token_ids: list[int], sampling: SamplingParams) -> torch.Tensor:
    """(T, V): log of the distribution each output token was sampled from: the target's logits at its
    position through temperature and the filters (``logits_to_probs``), -9999 where that is 0."""
    from verispec.sampling import logits_to_probs

    with torch.inference_mode():
        logits, _ = target.train_forward(torch.tensor([prompt_ids + token_ids]))
    probs = logits_to_probs(logits[0, len(prompt_ids) - 1:-1], sampling)
    return torch.log(probs).clamp_min(-9999.0)


def _run(engine, requests) -> dict[str, tuple[list[int], list[TokenLogprob]]]:
    events = [event for request in requests for event in engine.add(request)]
    while engine.active:
        events += engine.step()
    out = {}
    for request in requests:
        mine = [event for event in events if event.request_id == request.request_id]
        out[request.request_id] = ([t for e in mine for t in e.tokens], [lp for e in mine for lp in e.logprobs])
    return out


@pytest.mark.parametrize("method", ["model", "perfect", "ngram", "none", "tree", "perfect-tree"])
def test_processed_logprobs_are_the_sampling_distributions(pair, method):
    """``logprobs_mode="processed"``: each token's log-probability under the distribution it was drawn
    from (temperature, top-k, top-p applied; 0.0 for greedy picks), for accepted, recovered and bonus
    tokens alike (a tree's read off its accepted path's rows), equal to the target's own processed
    distribution at that position within 1e-5; raw mode in the same engine run still reports the raw
    log-softmax."""
    perfect = method.startswith("perfect")
    draft = pair.target if perfect else pair.draft
    engine = BatchEngine(pair.target, draft, SPECS[method], max_batch=4, logprobs_mode="processed")
    settings = {"t07k8": SamplingParams(temperature=0.7, top_k=8), "t1p9": SamplingParams(temperature=1.0, top_p=0.9),
                "greedy": SamplingParams(temperature=0)}
    prompt = encode(pair, "Hello")
    requests = [BatchRequest(name, prompt, sampling, StopRules(max_tokens=12, ignore_eos=True), seed=3, logprobs=3)
                for name, sampling in settings.items()]
    for name, (tokens, logprobs) in _run(engine, requests).items():
        oracle = _processed_oracle(pair.target, prompt, tokens, settings[name])
        assert len(logprobs) == len(tokens) == 12
        for position, (token, entry) in enumerate(zip(tokens, logprobs)):
            assert abs(entry.logprob - float(oracle[position, token])) <= TOLERANCE, (name, position)
            assert entry.logprob > -9999.0  # a sampled token always had probability > 0
            top = torch.topk(oracle[position], 3)
            assert list(entry.top_logprobs) == pytest.approx(top.values.tolist(), abs=TOLERANCE)
            if name == "greedy":
                assert entry.logprob == 0.0 and entry.top_logprobs[1:] == (-9999.0, -9999.0)


def test_logprobs_mode_is_a_server_option(pair):
    """``serve --logprobs-mode processed`` reaches the engine; an unknown mode is refused in one line."""
    from verispec.errors import VerispecError
    from verispec.server.app import build_batch_engine
    from verispec.server.cli import config_from_args
    import argparse
    from verispec.server.cli import add_parser

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve", "--target", "tiny", "--logprobs-mode", "processed"])
    spec, config = config_from_args(args)
    assert config.logprobs_mode == "processed"
    assert build_batch_engine(pair, SpecConfig(gamma=3), config, adaptive=False).logprobs_mode == "processed"
    assert ServerConfig().logprobs_mode == "raw"
    with pytest.raises(VerispecError, match="logprobs mode must be one of raw, processed"):
        BatchEngine(pair.target, pair.draft, SpecConfig(gamma=3), logprobs_mode="logits")
