"""verispec.server.service: one OpenAI request served from its choices' events, over a scheduler driving
a fake engine and a one-letter-per-token tokenizer (the live server is tested in test_server.py)."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")

from test_server_scheduler import FakeEngine  # noqa: E402
from verispec.batch import BatchEvent, BatchRequest  # noqa: E402
from verispec.config import StopRules  # noqa: E402
from verispec.server.metrics import ServerMetrics  # noqa: E402
from verispec.server.prepare import Prepared  # noqa: E402
from verispec.server.scheduler import Scheduler, ServerConfig  # noqa: E402
from verispec.server.schemas import ApiError  # noqa: E402
from verispec.server.service import Service, _prediction_counts, _sse_data  # noqa: E402


class Letters:
    """Token i is the letter chr(96 + i): 1 -> "a", 2 -> "b"."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(96 + i) for i in ids)


class Connected:
    async def is_disconnected(self) -> bool:
        return False


def prepared(n: int = 1, stream: bool = False, chat: bool = False, include_usage: bool = False) -> Prepared:
    requests = tuple(BatchRequest(f"x-{i}", [5, 6], stop=StopRules(max_tokens=3)) for i in range(n))
    return Prepared(requests, "x", chat, stream, include_usage, return_spec_stats=False)


def serve(body: Prepared, engine=None, config=ServerConfig(max_batch=4, max_queue=4)):
    async def main():
        metrics = ServerMetrics("m")
        scheduler = Scheduler(engine or FakeEngine(steps=2), config, metrics)
        service = Service(scheduler, None, metrics, Letters(), "m", config)
        scheduler.start()
        try:
            answer = await service.serve(body, Connected())
            if body.stream:
                answer = [chunk async for chunk in answer.body_iterator]
            return answer, metrics
        finally:
            await asyncio.to_thread(scheduler.shutdown, 1.0)

    return asyncio.run(main())


def test_a_whole_response_has_every_choices_text_and_the_usage():
    body, _ = serve(prepared(n=2))
    assert body["id"] == "x" and body["object"] == "text_completion" and body["model"] == "m"
    assert [(c["index"], c["text"], c["finish_reason"]) for c in body["choices"]] == [(0, "abb", "length"),
                                                                                       (1, "abb", "length")]
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 6, "total_tokens": 8}


def test_a_chat_stream_opens_with_the_role_and_ends_with_usage_and_done():
    chunks, _ = serve(prepared(stream=True, chat=True, include_usage=True))
    assert chunks[-1] == "data: [DONE]\n\n"
    bodies = [json.loads(chunk.removeprefix("data: ")) for chunk in chunks[:-1]]
    assert bodies[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(b["choices"][0]["delta"].get("content", "") for b in bodies[1:-1]) == "abb"
    assert bodies[-2]["choices"][0]["finish_reason"] == "length"
    assert bodies[-1]["choices"] == [] and bodies[-1]["usage"]["completion_tokens"] == 3


def test_a_request_past_its_deadline_is_aborted_with_504():
    config = ServerConfig(max_batch=1, max_queue=1, timeout_s=0.1)
    with pytest.raises(ApiError) as caught:
        serve(prepared(), FakeEngine(capacity=0), config)  # never admitted
    assert caught.value.status == 504 and caught.value.code == "timeout"


def test_more_choices_than_the_server_queues_are_a_400_and_a_full_queue_a_429():
    config = ServerConfig(max_batch=1, max_queue=1)
    with pytest.raises(ApiError) as caught:
        serve(prepared(n=3), config=config)
    assert caught.value.status == 400 and caught.value.param == "n"

    async def full():
        metrics = ServerMetrics("m")
        scheduler = Scheduler(FakeEngine(capacity=0), config, metrics)
        service = Service(scheduler, None, metrics, Letters(), "m", config)
        scheduler.start()
        try:
            scheduler.submit_all([BatchRequest("w", [1]), BatchRequest("v", [1])], asyncio.get_running_loop())
            with pytest.raises(ApiError) as caught:
                await service.serve(prepared(), Connected())
            return caught.value, metrics
        finally:
            await asyncio.to_thread(scheduler.shutdown, 0.0)

    error, metrics = asyncio.run(full())
    assert error.status == 429 and error.headers == {"Retry-After": "1"}
    assert metrics.registry.get_sample_value("verispec:request_failure_total",
                                             {"model_name": "m", "reason": "queue_full"}) == 1


def test_a_stop_token_ids_text_is_cut_from_the_output():
    service = Service(None, None, None, Letters(), "m", ServerConfig())
    body = Prepared(prepared().requests, "x", False, False, False, False, stop_token_ids=frozenset({3}))
    assert service._cut(body, [1, 2, 3], BatchEvent("x", [3], "stop")) == 2  # "ab", not "abc"
    assert service._cut(body, [1, 2, 3], BatchEvent("x", [3], "stop", stop_text_index=1)) == 1
    assert service._cut(body, [1, 2, 3], BatchEvent("x", [3], "length")) is None


def test_sse_data_and_prediction_counts():
    assert _sse_data({"a": [1, 2]}) == 'data: {"a":[1,2]}\n\n'
    assert _prediction_counts(prepared(), []) is None  # no prediction
    predicted = Prepared((BatchRequest("x", [5], prediction=[1, 2]),), "x", False, False, False, False)
    events = [BatchEvent("x-0", [], "stop", stats=SimpleNamespace(accepted=3, drafted=5)), None,
              BatchEvent("x-1", [], "stop", stats=SimpleNamespace(accepted=1, drafted=1))]
    assert _prediction_counts(predicted, events) == (4, 2)  # (accepted, rejected) over the choices
