"""Several choices per request (OpenAI's ``n``) and vLLM's ``stop_token_ids`` from ``verispec serve``,
through the official openai client, with speculation on (a draft model) and off.

Each choice is its own engine request, batched with the others; choice i samples with seed ``seed + i``,
so it is exactly the n=1 answer for that seed. Greedy choices are all the n=1 greedy answer.

The draft keeps its native weights: with int8 ones (``verispec serve``'s default) the draft runs them
only for up to ``kernels.INT8_ROWS`` rows, so under speculation a sampled answer (never its distribution)
can depend on how many rows share the batch, and "choice i is the n=1 answer" would hold only for small n.
"""

from __future__ import annotations

import contextlib
import json
import re
import time

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from test_server import MODEL, http, serving, until  # noqa: E402
from verispec.config import SamplingParams, SpecConfig, StopRules  # noqa: E402
from verispec.engine import SpecEngine  # noqa: E402
from verispec.loading import ModelPair, load_pair  # noqa: E402
from verispec.server.app import create_app  # noqa: E402
from verispec.server.scheduler import ServerConfig  # noqa: E402
from verispec.server.schemas import MAX_CHOICES  # noqa: E402

METHODS = {"chain": SpecConfig(gamma=3), "none": SpecConfig(method="none")}
MESSAGES = [{"role": "user", "content": "Say something."}]
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def pair(byte_pair) -> ModelPair:
    return load_pair(*byte_pair, draft_weights="native")


@pytest.fixture(scope="module")
def servers(pair):
    with contextlib.ExitStack() as stack:
        yield {method: stack.enter_context(serving(create_app(pair, spec, ServerConfig(max_batch=8, timeout_s=60))))
               for method, spec in METHODS.items()}


def complete(live, n: int = 1, prompt: str = "Hello", max_tokens: int = 10, temperature: float = 0, **options):
    extra = {"ignore_eos": True, **options.pop("extra_body", {})}
    return live.client().completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, n=n,
                                            temperature=temperature, extra_body=extra, **options)


def texts(result) -> list[str]:
    assert [choice.index for choice in result.choices] == list(range(len(result.choices)))
    return [choice.text if hasattr(choice, "text") else choice.message.content for choice in result.choices]


def streamed(chunks) -> tuple[dict[int, str], dict[int, list[str]], list]:
    """Per choice index: its text and its finish reasons (one per choice), and the chunks with usage."""
    text: dict[int, str] = {}
    finishes: dict[int, list[str]] = {}
    usage = []
    for chunk in chunks:
        if chunk.usage is not None:
            usage.append(chunk)
        for choice in chunk.choices:
            piece = choice.text if hasattr(choice, "text") else (choice.delta.content or "")
            text[choice.index] = text.get(choice.index, "") + piece
            if choice.finish_reason is not None:
                finishes.setdefault(choice.index, []).append(choice.finish_reason)
    return text, finishes, usage


# ---- n ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", METHODS)
def test_greedy_choices_are_all_the_single_answer(servers, method):
    live = servers[method]
    one = complete(live, max_tokens=12)
    three = complete(live, n=3, max_tokens=12)
    assert texts(three) == texts(one) * 3
    assert all(choice.finish_reason == "length" for choice in three.choices)
    assert three.usage.prompt_tokens == one.usage.prompt_tokens
    assert three.usage.completion_tokens == 3 * one.usage.completion_tokens == 36
    assert three.usage.total_tokens == three.usage.prompt_tokens + 36
    chat_one = live.client().chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0)
    chat_three = live.client().chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0,
                                                       n=3)
    assert texts(chat_three) == texts(chat_one) * 3
    assert chat_three.usage.completion_tokens == 3 * chat_one.usage.completion_tokens
    if method == "none":  # lossless: the draft model changes nothing
        assert texts(one) == texts(complete(servers["chain"], max_tokens=12))


@pytest.mark.parametrize("method", METHODS)
def test_sampled_choice_i_is_the_single_answer_with_seed_plus_i(servers, method):
    live = servers[method]
    options = dict(max_tokens=10, temperature=1.0, top_p=0.95)
    four = texts(complete(live, n=4, seed=11, **options))
    assert texts(complete(live, n=4, seed=11, **options)) == four  # reproducible
    assert len(set(four)) > 1  # the choices are sampled independently
    assert four == [texts(complete(live, seed=11 + i, **options))[0] for i in range(4)]
    unseeded = texts(complete(live, n=4, **options))
    assert len(unseeded) == 4 and len(set(unseeded)) > 1


@pytest.mark.parametrize("method", METHODS)
def test_streamed_choices_reassemble_to_the_whole_response(servers, method):
    live = servers[method]
    whole = complete(live, n=3, seed=5, temperature=1.0, max_tokens=12)
    stream = complete(live, n=3, seed=5, temperature=1.0, max_tokens=12, stream=True,
                      stream_options={"include_usage": True})
    text, finishes, usage = streamed(stream)
    assert [text[i] for i in range(3)] == texts(whole)
    assert finishes == {i: [whole.choices[i].finish_reason] for i in range(3)}
    assert len(usage) == 1 and usage[0].usage.completion_tokens == whole.usage.completion_tokens == 36
    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=1.0, seed=2, n=3)
    chat_whole = live.client().chat.completions.create(**kwargs)
    chunks = list(live.client().chat.completions.create(stream=True, stream_options={"include_usage": True},
                                                        **kwargs))
    roles = [c.choices[0].index for c in chunks if c.choices and c.choices[0].delta.role == "assistant"]
    assert sorted(roles) == [0, 1, 2]
    text, finishes, usage = streamed(chunks)
    assert [text[i] for i in range(3)] == texts(chat_whole)
    assert {i: len(f) for i, f in finishes.items()} == {0: 1, 1: 1, 2: 1}
    assert usage[-1] is chunks[-1] and usage[-1].usage.completion_tokens == chat_whole.usage.completion_tokens


def test_each_choice_has_its_own_logprobs(servers):
    live = servers["chain"]
    options = dict(max_tokens=8, temperature=1.0, logprobs=2)
    two = complete(live, n=2, seed=21, **options)
    for i, choice in enumerate(two.choices):
        alone = complete(live, seed=21 + i, **options).choices[0]
        assert choice.text == alone.text and choice.logprobs.tokens == alone.logprobs.tokens
        assert len(choice.logprobs.tokens) == 8
        assert choice.logprobs.token_logprobs == pytest.approx(alone.logprobs.token_logprobs, abs=TOLERANCE)
    chunks = list(complete(live, n=2, seed=21, stream=True, **options))
    for i, choice in enumerate(two.choices):
        tokens = [t for c in chunks for ch in c.choices if ch.index == i and ch.logprobs for t in ch.logprobs.tokens]
        assert tokens == choice.logprobs.tokens
    reply = live.client().chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0, n=2,
                                                  logprobs=True, top_logprobs=2)
    first, second = (choice.logprobs.content for choice in reply.choices)
    assert [e.token for e in first] == [e.token for e in second] and len(first) == reply.usage.completion_tokens // 2


@pytest.mark.parametrize("method", METHODS)
def test_every_choice_follows_the_grammar(servers, method):
    """Each choice has its own grammar constraint: sharing one would let a choice's tokens advance
    another's matcher, and the outputs would break the pattern."""
    pytest.importorskip("llguidance")
    live = servers[method]
    pattern = r"(yes|no), [0-9]{1,3}!"
    for stream in (False, True):
        result = complete(live, n=3, seed=7, temperature=1.0, max_tokens=16, stream=stream,
                          extra_body={"structured_outputs": {"regex": pattern}, "ignore_eos": False})
        outputs = list(streamed(result)[0].values()) if stream else texts(result)
        assert len(outputs) == 3
        assert all(re.fullmatch(pattern, text) for text in outputs), outputs
    reply = live.client().chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=60, temperature=1.0,
                                                  seed=3, n=3, response_format={"type": "json_object"})
    for choice in reply.choices:
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content), dict)
        else:  # cut by max_tokens: a JSON object's beginning
            assert choice.message.content.startswith("{")


def test_return_spec_stats_per_choice(servers):
    url = f"{servers['chain'].url}/v1/completions"
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 6, "temperature": 0, "ignore_eos": True, "n": 2,
            "return_spec_stats": True}
    status, _, text = http(url, body)
    response = json.loads(text)
    assert status == 200 and response["spec_stats"] == response["choices"][0]["spec_stats"]
    assert all(choice["spec_stats"]["generated_tokens"] == 6 for choice in response["choices"])
    status, _, text = http(url, {**body, "n": 1})
    assert "spec_stats" in json.loads(text) and "spec_stats" not in json.loads(text)["choices"][0]
    status, _, text = http(url, {**body, "stream": True})
    events = [json.loads(line[len("data: "):]) for line in text.splitlines() if line.startswith("data: {")]
    finals = [e for e in events if e["choices"] and e["choices"][0]["finish_reason"]]
    assert sorted(e["choices"][0]["index"] for e in finals) == [0, 1]
    assert all(e["spec_stats"]["generated_tokens"] == 6 for e in finals) and text.rstrip().endswith("data: [DONE]")


def test_a_client_disconnect_aborts_every_choice(servers, monkeypatch):
    live = servers["chain"]
    step = live.scheduler.engine.step
    monkeypatch.setattr(live.scheduler.engine, "step", lambda: time.sleep(0.005) or step())
    aborted = live.metric("verispec:request_success_total", finished_reason="abort")
    stream = complete(live, n=3, prompt="long", max_tokens=400, stream=True)
    next(iter(stream))
    stream.close()
    assert until(lambda: live.metric("verispec:request_success_total", finished_reason="abort") == aborted + 3)
    assert until(lambda: live.scheduler.engine.active == 0 and not live.scheduler._running)


def test_more_choices_than_batch_rows_wait_their_turn(pair, servers):
    """Choices beyond the free rows queue like requests; more than rows + queue can ever hold is a 400."""
    with serving(create_app(pair, SpecConfig(gamma=3), ServerConfig(max_batch=2, max_queue=3, timeout_s=60))) as small:
        five = complete(small, n=5, seed=4, temperature=1.0, max_tokens=6)
        assert texts(five) == texts(complete(servers["chain"], n=5, seed=4, temperature=1.0, max_tokens=6))
        assert five.usage.completion_tokens == 30
        status, _, text = http(f"{small.url}/v1/completions", {"model": MODEL, "prompt": "hi", "n": 6})
        assert status == 400 and json.loads(text)["error"]["param"] == "n", text
        assert until(lambda: small.scheduler.engine.active == 0 and not small.scheduler._running)


# ---- stop_token_ids ---------------------------------------------------------------------------------------


def test_stop_token_ids_stop_at_the_token(pair, servers):
    prompt = list(pair.tokenizer.encode("Hello", add_special_tokens=False))
    tokens = SpecEngine(pair.target).generate(prompt, sampling=SamplingParams(temperature=0),
                                              spec=SpecConfig(method="none"),
                                              stop=StopRules(max_tokens=12, ignore_eos=True)).tokens
    at = next(k for k in range(3, 12) if tokens[k] not in tokens[:k])
    expected = pair.tokenizer.decode(tokens[:at], skip_special_tokens=True).rstrip("\ufffd")
    for method, live in servers.items():
        for ignore_eos in (True, False):
            result = complete(live, n=2, max_tokens=12, extra_body={"stop_token_ids": [tokens[at]],
                                                                    "ignore_eos": ignore_eos})
            assert texts(result) == [expected] * 2, (method, ignore_eos)
            assert [c.finish_reason for c in result.choices] == ["stop", "stop"]
            assert result.usage.completion_tokens == 2 * (at + 1)  # the stop token is generated, not shown
        chunks = complete(live, max_tokens=12, stream=True, extra_body={"stop_token_ids": [tokens[at], 0]})
        text, finishes, _ = streamed(chunks)
        assert text == {0: expected} and finishes == {0: ["stop"]}
    unrelated = complete(servers["chain"], max_tokens=12, extra_body={"stop_token_ids": [t for t in range(300)
                                                                                          if t not in tokens][:3]})
    assert unrelated.choices[0].finish_reason == "length"


# ---- errors ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path, body, param", [
    ("completions", {"n": 0}, "n"),
    ("completions", {"n": -1}, "n"),
    ("completions", {"n": MAX_CHOICES + 1}, "n"),
    ("chat/completions", {"n": 1000}, "n"),
    ("completions", {"n": 2, "seed": 2**64 - 1}, "seed"),
    ("completions", {"stop_token_ids": [-1]}, "stop_token_ids"),
    ("completions", {"stop_token_ids": [10**9]}, "stop_token_ids"),
    ("chat/completions", {"stop_token_ids": [3, 99999]}, "stop_token_ids"),
    ("completions", {"stop_token_ids": ["a"]}, "stop_token_ids"),
    ("completions", {"stop_token_ids": 5}, "stop_token_ids"),
])
def test_bad_n_and_stop_token_ids_get_400(servers, path, body, param):
    base = {"model": MODEL, "max_tokens": 4}
    base.update({"prompt": "hi"} if path == "completions" else {"messages": MESSAGES})
    status, _, text = http(f"{servers['chain'].url}/v1/{path}", {**base, **body})
    error = json.loads(text)["error"]
    assert status == 400 and error["param"] == param and error["type"] == "invalid_request_error", (status, error)
    if param == "n":
        assert f"1..{MAX_CHOICES}" in error["message"]
