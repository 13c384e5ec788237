"""The HTTP layer around the routes of ``verispec.server.app``: the API-key and body-size guard
(``add_guard``), errors as OpenAI's error body (``add_error_handlers``) and the OpenAPI schema without
FastAPI's 422 responses (``openapi_without_422``)."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from verispec.server import schemas
from verispec.server.scheduler import ServerConfig
from verispec.server.schemas import ApiError


def openapi_without_422(app: FastAPI) -> dict:
    """FastAPI's schema without its 422 validation responses: this server answers a bad request with
    400 and OpenAI's error body (documented per route)."""
    if app.openapi_schema is None:
        from fastapi.openapi.utils import get_openapi

        spec = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
        for operations in spec.get("paths", {}).values():
            for operation in operations.values():
                operation.get("responses", {}).pop("422", None)
        schemas_section = spec.get("components", {}).get("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            schemas_section.pop(name, None)
        app.openapi_schema = spec
    return app.openapi_schema


def add_guard(app: FastAPI, config: ServerConfig) -> None:
    """Access control and the body limit, before a request is read: without ``Authorization: Bearer KEY``
    every path but /health (and /metrics with ``metrics_public``) answers 401; a declared body over
    ``max_body_bytes`` answers 413. A plain ASGI middleware: Starlette's ``BaseHTTPMiddleware`` would
    hide client disconnects from the handlers, which abort a request's sequence on them."""
    app.add_middleware(_Guard, config=config)


class _Guard:
    def __init__(self, app, config: ServerConfig):
        self.app, self.config = app, config
        self.open_paths = {"/health"} | ({"/metrics"} if config.metrics_public else set())
        self.expected = f"Bearer {config.api_key}".encode() if config.api_key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        import hmac

        headers = dict(scope.get("headers") or ())
        if self.expected is not None and scope.get("path") not in self.open_paths \
                and not hmac.compare_digest(headers.get(b"authorization", b""), self.expected):
            body = schemas.error_body("a valid API key is needed: send the header 'Authorization: Bearer <key>'",
                                      code="invalid_api_key")
            return await JSONResponse(body, status_code=401)(scope, receive, send)
        declared = headers.get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.config.max_body_bytes:
            body = schemas.error_body(f"the request body is {int(declared)} bytes; this server takes at most "
                                      f"{self.config.max_body_bytes}", code="body_too_large")
            return await JSONResponse(body, status_code=413)(scope, receive, send)
        return await self.app(scope, receive, send)


def add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, err: ApiError):
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, err: RequestValidationError):
        errors = err.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":
            detail = first.get("ctx", {}).get("error", "")
            return JSONResponse(schemas.error_body(f"the request body is not valid JSON ({detail})"), status_code=400)
        fields = [".".join(str(part) for part in e.get("loc", ()) if part != "body") for e in errors]
        messages = [f"{field}: {e.get('msg')}" if field else f"the request body: {e.get('msg')}"
                    for field, e in zip(fields, errors)]
        param = next((str(e["loc"][1]) for e in errors if len(e.get("loc", ())) > 1), None)
        return JSONResponse(schemas.error_body("; ".join(dict.fromkeys(messages[:3])), param=param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException):
        kind = "not_found_error" if err.status_code == 404 else "invalid_request_error"
        return JSONResponse(schemas.error_body(str(err.detail), type=kind), status_code=err.status_code,
                            headers=getattr(err, "headers", None))
