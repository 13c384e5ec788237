"""verispec.server.middleware: the API-key and body-size guard, OpenAI error bodies, and the OpenAPI schema
without FastAPI's 422s, around a bare app (the live server's tests are in test_server.py)."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")  # starlette's TestClient

from fastapi import FastAPI  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402
from pydantic import BaseModel  # noqa: E402

from verispec.server.middleware import add_error_handlers, add_guard, openapi_without_422  # noqa: E402
from verispec.server.scheduler import ServerConfig  # noqa: E402
from verispec.server.schemas import ApiError  # noqa: E402


class Body(BaseModel):
    count: int


def bare_app(config: ServerConfig) -> FastAPI:
    app = FastAPI()
    add_error_handlers(app)
    add_guard(app, config)

    @app.post("/echo")
    async def echo(body: Body):
        if body.count < 0:
            raise ApiError(429, "busy", type="rate_limit_exceeded", code="queue_full", headers={"Retry-After": "1"})
        return {"count": body.count}

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return {}

    app.openapi = lambda: openapi_without_422(app)
    return app


def test_a_key_is_needed_everywhere_but_health():
    client = TestClient(bare_app(ServerConfig(api_key="k")))
    answer = client.post("/echo", json={"count": 1})
    assert answer.status_code == 401 and answer.json()["error"]["code"] == "invalid_api_key"
    assert client.post("/echo", json={"count": 1}, headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert client.post("/echo", json={"count": 1}, headers={"Authorization": "Bearer k"}).json() == {"count": 1}
    assert client.get("/health").status_code == 200 and client.get("/metrics").status_code == 401
    public = TestClient(bare_app(ServerConfig(api_key="k", metrics_public=True)))
    assert public.get("/metrics").status_code == 200


def test_a_declared_body_over_the_limit_is_413():
    client = TestClient(bare_app(ServerConfig(max_body_bytes=16)))
    answer = client.post("/echo", content=b'{"count": 1}' + b" " * 20, headers={"Content-Type": "application/json"})
    assert answer.status_code == 413
    assert answer.json()["error"] == {"message": "the request body is 32 bytes; this server takes at most 16",
                                      "type": "invalid_request_error", "param": None, "code": "body_too_large"}


def test_errors_are_openais_body_with_400_for_what_fastapi_calls_422():
    client = TestClient(bare_app(ServerConfig()))
    bad_type = client.post("/echo", json={"count": "many"})
    assert bad_type.status_code == 400
    assert bad_type.json()["error"]["param"] == "count" and bad_type.json()["error"]["message"].startswith("count: ")
    bad_json = client.post("/echo", content=b"{", headers={"Content-Type": "application/json"})
    assert bad_json.status_code == 400 and "not valid JSON" in bad_json.json()["error"]["message"]
    missing = client.get("/nowhere")
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
    busy = client.post("/echo", json={"count": -1})
    assert busy.status_code == 429 and busy.headers["Retry-After"] == "1"
    assert busy.json()["error"]["code"] == "queue_full"


def test_the_openapi_schema_has_no_422():
    spec = TestClient(bare_app(ServerConfig())).get("/openapi.json").json()
    assert "422" not in spec["paths"]["/echo"]["post"]["responses"]
    assert "HTTPValidationError" not in spec["components"]["schemas"] and "Body" in spec["components"]["schemas"]
