"""Structured outputs from ``verispec serve`` through the official openai client: response_format
(json_object, json_schema) and structured_outputs (json, regex, grammar), streaming and not, with
speculation on and off. Greedy text is the same either way; sampled JSON validates every time; what the
server cannot do is a 400 naming the field."""

from __future__ import annotations

import contextlib
import json
import re
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("llguidance")
openai = pytest.importorskip("openai")
jsonschema_rs = pytest.importorskip("jsonschema_rs")

from test_server import MODEL, http, serving  # noqa: E402
from verispec.config import SpecConfig  # noqa: E402
from verispec.loading import load_pair  # noqa: E402
from verispec.server.app import create_app  # noqa: E402
from verispec.server.scheduler import ServerConfig  # noqa: E402

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                            "maximum": 999},
                                           "name": {"type": "string", "maxLength": 6}},
          "required": ["ok", "n", "name"], "additionalProperties": False}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
REGEX = r"(yes|no), [0-9]{1,3}"
MESSAGES = [{"role": "user", "content": "Give me the answer as JSON."}]
METHODS = {"chain": SpecConfig(gamma=3), "ngram": SpecConfig(gamma=3, drafter="ngram"), "none": SpecConfig(method="none")}


@pytest.fixture(scope="module")
def servers(byte_pair):
    pair = load_pair(*byte_pair)
    with contextlib.ExitStack() as stack:
        yield {method: stack.enter_context(serving(create_app(pair, spec, ServerConfig(max_batch=8, timeout_s=60))))
               for method, spec in METHODS.items()}


def chat_text(live, stream: bool, **options) -> tuple[str, str]:
    client = live.client()
    if not stream:
        response = client.chat.completions.create(model=MODEL, messages=MESSAGES, **options)
        return response.choices[0].message.content, response.choices[0].finish_reason
    text, finish = "", None
    for chunk in client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True, **options):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    return text, finish


@pytest.mark.parametrize("stream", [False, True])
def test_greedy_json_schema_output_is_the_same_with_and_without_speculation(servers, stream):
    outputs = {method: chat_text(live, stream, response_format=RESPONSE_FORMAT, temperature=0, max_tokens=80)
               for method, live in servers.items()}
    text, finish = outputs["none"]
    assert finish == "stop" and jsonschema_rs.is_valid(SCHEMA, json.loads(text)), text
    assert all(output == outputs["none"] for output in outputs.values()), outputs


def test_two_hundred_sampled_answers_all_validate(servers):
    def ask(index: int):
        live = servers[("chain", "none")[index % 2]]
        return chat_text(live, index % 4 >= 2, response_format=RESPONSE_FORMAT, temperature=1.0, max_tokens=80,
                         seed=index)

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, range(200)))
    finished = [text for text, finish in answers if finish == "stop"]
    assert len(finished) >= 190, [a for a in answers if a[1] != "stop"][:3]  # a 999-long run may hit max_tokens
    invalid = [text for text in finished if not jsonschema_rs.is_valid(SCHEMA, json.loads(text))]
    assert not invalid, invalid[:3]


def test_json_object_gives_a_json_object(servers):
    text, finish = chat_text(servers["chain"], False, response_format={"type": "json_object"}, temperature=0.8,
                             max_tokens=120, seed=3)
    if finish == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # cut by max_tokens: still a prefix of a JSON object
        assert text.startswith("{")


@pytest.mark.parametrize("stream", [False, True])
def test_completions_take_a_regex_and_a_lark_grammar(servers, stream):
    for structured, pattern in (({"regex": REGEX}, REGEX), ({"grammar": 'start: "id-" /[a-f0-9]{4}/'}, r"id-[a-f0-9]{4}")):
        for method in ("chain", "none"):
            options = dict(model=MODEL, prompt="Answer: ", max_tokens=24, temperature=0,
                           extra_body={"structured_outputs": structured})
            if stream:
                text = "".join(c.choices[0].text for c in servers[method].client().completions.create(stream=True, **options)
                               if c.choices)
            else:
                text = servers[method].client().completions.create(**options).choices[0].text
            assert re.fullmatch(pattern, text), (structured, method, text)


@pytest.mark.parametrize("body, param, message", [
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema.schema"),
    ({"response_format": {"type": "xml"}}, "response_format", "text, json_object or json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "object", "properties": {"a": {"type": 7}}}}}},
     "response_format", "does not compile"),
    ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs", "does not compile"),
    ({"structured_outputs": {"regex": "a", "grammar": "start: \"a\""}}, "structured_outputs", "exactly one of"),
    ({"structured_outputs": {"choice": ["a", "b"]}}, "structured_outputs", "exactly one of"),
    ({"structured_outputs": {"regex": 5}}, "structured_outputs", "must be a string"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs",
     "not both"),
])
def test_what_cannot_be_served_is_a_400_naming_the_field(servers, body, param, message):
    status, _, text = http(f"{servers['chain'].url}/v1/chat/completions",
                           {"model": MODEL, "messages": MESSAGES, "max_tokens": 8, **body})
    error = json.loads(text)["error"]
    assert status == 400 and error["param"] == param and message in error["message"], (status, error)
