"""audit_endpoint_client.py: an OpenAI-compatible server as the endpoint audit sees it: base URLs, the
request body, and the ignore_eos probe against a stub server that refuses it."""

from __future__ import annotations

import http.server
import json
import threading
from collections import Counter

import pytest

from verispec.audit_endpoint_client import Endpoint, base_url, settle_ignore_eos
from verispec.audit_endpoint_sampling import sample_prompts
from verispec.config import SamplingParams
from verispec.errors import VerispecError

SAMPLING = SamplingParams(temperature=3.0, top_k=4)


def test_base_url():
    for url in ("http://h:8000", "http://h:8000/", "http://h:8000/v1", "http://h:8000/v1/", " http://h:8000/v1 "):
        assert base_url(url) == "http://h:8000"
    assert base_url("https://proxy.example/openai/v1") == "https://proxy.example/openai"
    for bad in ("localhost:8000", "ftp://h/v1", "http://"):
        with pytest.raises(VerispecError, match="http"):
            base_url(bad)


class _Refuses(http.server.BaseHTTPRequestHandler):
    """OpenAI's own API: unknown parameters are a 400; otherwise every completion is "ok"."""

    def log_message(self, *args):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if "ignore_eos" in body:
            status, answer = 400, {"error": {"message": "Unrecognized request argument supplied: ignore_eos",
                                             "type": "invalid_request_error"}}
        else:
            status, answer = 200, {"choices": [{"index": i, "text": "ok", "finish_reason": "length"}
                                               for i in range(body.get("n", 1))]}
        data = json.dumps(answer).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def test_ignore_eos_auto_drops_what_the_server_refuses():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Refuses)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        stub = Endpoint(f"http://127.0.0.1:{server.server_address[1]}", "m")
        note = settle_ignore_eos(stub, "auto", "hi", SAMPLING, 3)
        assert not stub.ignore_eos and "refused ignore_eos" in note
        assert stub.sample("hi", SAMPLING, 3, seed=1, choices=2) == [("ok", "length"), ("ok", "length")]
        with pytest.raises(VerispecError, match="HTTP 400: Unrecognized request argument supplied: ignore_eos"):
            settle_ignore_eos(stub, "yes", "hi", SAMPLING, 3) or stub.sample("hi", SAMPLING, 3, seed=1)
        settle_ignore_eos(stub, "no", "hi", SAMPLING, 3)
        texts, finish = sample_prompts(stub, ["hi"], SAMPLING, 3, 64, choices=16)[0]
        assert texts == Counter({"ok": 64}) and finish == Counter({"length": 64})
    finally:
        server.shutdown()
        server.server_close()


def test_the_request_body_sends_only_what_is_not_off():
    endpoint = Endpoint("http://h:8000", "m")
    route, body = endpoint.body("hi", SamplingParams(temperature=0.5, top_k=3), 4, seed=7, choices=2)
    assert route == "completions"
    assert body == {"model": "m", "max_tokens": 4, "seed": 7, "temperature": 0.5, "top_p": 1.0, "stream": False,
                    "n": 2, "top_k": 3, "ignore_eos": True, "prompt": "hi"}
    endpoint.logprobs = True
    assert endpoint.body([1, 2], SamplingParams(), 4, seed=0, choices=1)[1]["logprobs"] == 0  # no alternatives


def test_a_chat_prompt_goes_to_chat_completions_as_a_user_message():
    from verispec.audit import CHAT_PREFIX

    endpoint = Endpoint("http://h:8000", "m", ignore_eos=False, logprobs=True)
    route, body = endpoint.body(CHAT_PREFIX + "hello", SamplingParams(min_p=0.1), 3, seed=1, choices=1)
    assert route == "chat/completions"
    assert body == {"model": "m", "max_tokens": 3, "seed": 1, "temperature": 1.0, "top_p": 1.0, "stream": False,
                    "min_p": 0.1, "logprobs": True, "messages": [{"role": "user", "content": "hello"}]}


def test_logprob_sums_are_keyed_by_the_tokens_and_none_where_missing():
    from verispec.audit_endpoint_client import _logprob_sum

    completion = {"logprobs": {"tokens": ["a", "b"], "token_logprobs": [-0.5, -1.0]}}
    assert _logprob_sum(completion, chat=False) == (("a", "b"), -1.5)
    chat = {"logprobs": {"content": [{"token": "x", "logprob": -0.25}, {"token": "y", "logprob": -0.5}]}}
    assert _logprob_sum(chat, chat=True) == (("x", "y"), -0.75)
    for choice in ({}, {"logprobs": None}, {"logprobs": {"tokens": ["a"], "token_logprobs": [None]}},
                   {"logprobs": {"tokens": ["a", "b"], "token_logprobs": [-1.0]}}):
        assert _logprob_sum(choice, chat=False) is None, choice


def test_error_details_are_one_short_line():
    from verispec.audit_endpoint_client import _error_detail

    assert _error_detail(b'{"error": {"message": "model  not\\nfound"}}') == "model not found"
    assert _error_detail(b'{"detail": "Not Found"}') == "Not Found"
    assert _error_detail(b"<html>bad gateway</html>") == "<html>bad gateway</html>"
    assert _error_detail(b"x" * 400) == "x" * 297 + "..."
