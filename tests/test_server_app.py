"""verispec.server.app: the app's routes and what ``build_batch_engine`` refuses, in process through
Starlette's TestClient (uvicorn, the openai client and concurrency are tested in test_server.py)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")
pytest.importorskip("httpx")  # starlette's TestClient

from fastapi.testclient import TestClient  # noqa: E402

from verispec.config import SpecConfig  # noqa: E402
from verispec.errors import VerispecError  # noqa: E402
from verispec.loading import DEFAULT_TARGET, load_pair  # noqa: E402
from verispec.server.app import build_batch_engine, create_app, default_model_name  # noqa: E402
from verispec.server.scheduler import ServerConfig  # noqa: E402


def test_the_served_model_is_named_after_its_directory_or_file():
    assert default_model_name(SimpleNamespace(target_dir=Path("/models/SmolLM2-360M"))) == "SmolLM2-360M"
    assert default_model_name(SimpleNamespace(target_dir=Path("/models/qwen-0.5b.Q8_0.GGUF"))) == "qwen-0.5b.Q8_0"
    assert default_model_name(SimpleNamespace(target_dir=DEFAULT_TARGET)) == "verispec-default"


@pytest.mark.parametrize("adaptive, spec, profile, message", [
    (True, SpecConfig(method="none"), None, "--adaptive chooses how many drafts to verify"),
    (False, SpecConfig(gamma=2), {"gammas": []}, "--profile seeds the adaptive policy: add --adaptive"),
])
def test_options_that_do_not_go_together_are_refused(adaptive, spec, profile, message):
    pair = SimpleNamespace(bridge=None)
    with pytest.raises(VerispecError, match=message):
        build_batch_engine(pair, spec, ServerConfig(max_batch=1), adaptive, profile)


def test_routes_answer_through_the_lifespans_scheduler(byte_pair):
    pair = load_pair(*byte_pair)
    app = create_app(pair, SpecConfig(gamma=2), ServerConfig(max_batch=2, max_model_len=64), model_name="tiny")
    with TestClient(app) as client:
        assert client.get("/health").json() == {"status": "ok"}
        models = client.get("/v1/models").json()["data"]
        assert [(m["id"], m["max_model_len"]) for m in models] == [("tiny", 64)]
        answer = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3, "temperature": 0,
                                                      "ignore_eos": True}).json()
        assert answer["model"] == "tiny" and answer["usage"]["completion_tokens"] == 3
        assert answer["choices"][0]["finish_reason"] == "length"
        too_long = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 100})
        assert too_long.status_code == 400 and too_long.json()["error"]["code"] == "context_length_exceeded"
        metrics = client.get("/metrics").text
        assert 'verispec:generation_tokens_total{model_name="tiny"} 3.0' in metrics
    assert client.app.state.scheduler.accepting is False  # shut down with the lifespan
