"""The FastAPI app: OpenAI routes, health, metrics, error bodies, and the lifespan that runs the scheduler.

    pair = load_pair(target_dir, draft_dir)
    app = create_app(pair, SpecConfig(gamma=4), ServerConfig(max_batch=16))
    GracefulServer(uvicorn.Config(app, host="127.0.0.1", port=8000)).run()

Routes: POST /v1/completions and /v1/chat/completions (JSON, or SSE chunks ending ``data: [DONE]``
with ``stream: true``), GET /v1/models, /health (503 once the engine failed or while shutting down)
and /metrics (Prometheus). Every error is OpenAI's body ``{"error": {message, type, param, code}}``:
400 for a bad request (including malformed JSON, instead of FastAPI's 422), 429 + Retry-After when the
queue is full, 500 when the engine failed mid-request, 503 when it cannot take requests, 504 when a
request ran past ``--timeout``.

A request with ``n`` choices runs as n engine requests, batched together; its response has n choices
(a stream: chunks tagged with the choice's index, each choice its own final chunk, ``[DONE]`` after the
last). A request whose client goes away is aborted in the engine, every choice of it (non-streamed:
polled with ``is_disconnected``; streamed: the response generator is cancelled), as is one past its
deadline or one whose other choice failed.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
import logging
import signal
import time
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from verispec import profile as profiler
from verispec.adaptive import AdaptiveGamma, FixedGamma
from verispec.batch import BatchEngine, BatchEvent
from verispec.config import SpecConfig
from verispec.errors import VerispecError
from verispec.loading import DEFAULT_TARGET, ModelPair, check_backend_supports
from verispec.policy_trace import PolicyTrace
from verispec.server import schemas
from verispec.server.logprobs import LogprobReport, TokenStrings
from verispec.server.metrics import ServerMetrics
from verispec.server.prepare import Prepared, RequestBuilder
from verispec.server.scheduler import (EngineFailed, Handle, QueueFull, Scheduler, ServerConfig, Unavailable,
                                       next_of)
from verispec.server.schemas import ApiError, ChatCompletionRequest, CompletionRequest
from verispec.server.text import REPLACEMENT, StreamText, final_text

log = logging.getLogger(__name__)

DISCONNECT_POLL_S = 0.25  # how often a waiting non-streamed request checks that its client is still there


class GracefulServer(uvicorn.Server):
    """uvicorn, with the scheduler's shutdown first: stop taking requests, give in-flight ones
    ``shutdown_s`` to finish, abort the rest (they get a 503 body or an error chunk, never a cut
    connection), join the engine thread; only then does uvicorn close connections.

        GracefulServer(uvicorn.Config(app, host="127.0.0.1", port=8000)).run()
    """

    async def shutdown(self, sockets=None) -> None:
        await asyncio.to_thread(self.config.app.state.scheduler.shutdown)
        await super().shutdown(sockets)
        # uvicorn re-raises the signal that stopped it once it is done; SIGTERM would then kill the
        # process with -15 after a clean, complete shutdown. Exit 0 instead, as after Ctrl-C.
        captured = getattr(self, "_captured_signals", None)
        if isinstance(captured, list):
            captured[:] = [number for number in captured if number != signal.SIGTERM]


def default_model_name(pair: ModelPair) -> str:
    if pair.target_dir.resolve() == DEFAULT_TARGET.resolve():
        return "verispec-default"
    return pair.target_dir.stem if pair.target_dir.suffix.lower() == ".gguf" else pair.target_dir.name


def load_served_pair(target, draft, spec: SpecConfig, device: str = "cpu", backend: str = "auto",
                     draft_weights: str = "int8", draft_vocab: str | int | None = "auto",
                     eagle: str | None = None) -> tuple[ModelPair, SpecConfig]:
    """The pair a server runs and the spec it runs it with, as ``serve`` and each Ray replica load them: a
    draft model only for the draft-model method (its draft vocabulary resolved), the EAGLE head for
    ``eagle``, and a draft with the target's tokenizer (a cross-tokenizer draft is refused)."""
    from verispec.loading import check_model_args, load_pair, resolve_draft_vocab

    needs_draft = spec.enabled and spec.drafter == "model"
    check_model_args(target, draft, needs_draft)
    pair = load_pair(target, draft, device=device, need_draft=needs_draft, backend=backend,
                     draft_weights=draft_weights, need_eagle=spec.enabled and spec.drafter == "eagle",
                     eagle_dir=eagle, cross_vocab=False)
    if needs_draft:
        spec = dataclasses.replace(spec, draft_vocab=resolve_draft_vocab(pair, draft_vocab))
    return pair, spec


def build_batch_engine(pair: ModelPair, spec: SpecConfig, config: ServerConfig, adaptive: bool,
                       profile: dict | None = None, trace_rounds: str | None = None,
                       make_drafter=None) -> BatchEngine:
    """``profile``: a calibrated ``verispec profile`` JSON that seeds the adaptive policy at batch 1.
    ``trace_rounds``: a file the policy's decisions are appended to, a JSON line per round
    (``verispec.policy_trace``). ``make_drafter``: builds a drafter of your own per running request
    (``BatchEngine``)."""
    if pair.bridge is not None and spec.enabled and spec.drafter == "model":
        raise VerispecError("the server's draft must use the target's tokenizer (a draft with another tokenizer "
                            "drafts in generate, audit and bench)")
    if adaptive and not spec.enabled:
        raise VerispecError("--adaptive chooses how many drafts to verify; it needs speculation (drop --method none)")
    if profile is not None and not adaptive:
        raise VerispecError("--profile seeds the adaptive policy: add --adaptive")
    policy = AdaptiveGamma(max_gamma=spec.gamma) if adaptive else None
    if profile is not None:
        try:
            profiler.seed_policy(policy, profile)
        except (ValueError, KeyError) as err:
            raise VerispecError(f"--profile cannot seed the policy: {err}") from None
    check_backend_supports(pair, spec)
    if not all(m.capabilities.batching for m in (pair.target, pair.draft) if m is not None):
        raise VerispecError("the server batches requests with the native model (Llama, Qwen2, Mistral); the "
                            "transformers adapter (--backend hf, other architectures) and the compressed-attention "
                            "model decode one request at a time: use verispec generate")
    if trace_rounds is not None:
        try:
            policy = PolicyTrace(policy or FixedGamma(spec.gamma if spec.enabled else 0), trace_rounds)
        except OSError as err:
            raise VerispecError(f"--trace-rounds: cannot open {trace_rounds!r}: {err}") from None
    decoder = copy.deepcopy(pair.tokenizer)  # the engine thread's own copy: tokenizers are not thread-safe
    return BatchEngine(pair.target, pair.draft, spec, max_batch=config.max_batch,
                       max_len=min(config.max_model_len, pair.target.config.max_context),
                       decode=lambda ids: decoder.decode(ids, skip_special_tokens=True),
                       gamma_policy=policy, eagle=pair.eagle, logprobs_mode=config.logprobs_mode,
                       make_drafter=make_drafter)


def create_app(pair: ModelPair, spec: SpecConfig = SpecConfig(), config: ServerConfig = ServerConfig(),
               adaptive: bool = False, model_name: str | None = None, profile: dict | None = None,
               trace_rounds: str | None = None, make_drafter=None) -> FastAPI:
    model_name = model_name or default_model_name(pair)
    engine = build_batch_engine(pair, spec, config, adaptive, profile, trace_rounds, make_drafter)
    metrics = ServerMetrics(model_name)
    scheduler = Scheduler(engine, config, metrics)
    builder = RequestBuilder(pair.tokenizer, pair.target, model_name, scheduler.check, engine.max_len)
    service = _Service(scheduler, builder, metrics, pair.tokenizer, model_name, config)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        scheduler.start()
        yield
        await asyncio.to_thread(scheduler.shutdown)  # a worker thread: handlers still finishing need the loop

    app = FastAPI(title="verispec", summary="OpenAI-compatible server with lossless speculative decoding",
                  lifespan=lifespan)
    app.state.scheduler, app.state.metrics, app.state.model_name = scheduler, metrics, model_name
    _add_error_handlers(app)
    _add_guard(app, config)

    @app.post("/v1/completions", responses=schemas.REQUEST_RESPONSES)
    async def completions(body: CompletionRequest, request: Request):
        return await service.serve(builder.completion(body), request)

    @app.post("/v1/chat/completions", responses=schemas.REQUEST_RESPONSES)
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await service.serve(builder.chat(body), request)

    @app.get("/v1/models", responses=schemas.AUTH_RESPONSES)
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": service.started,
                                            "owned_by": "verispec", "root": str(pair.target_dir),
                                            "max_model_len": engine.max_len}]}

    @app.get("/health", responses=schemas.HEALTH_RESPONSES)
    async def health():
        if scheduler.accepting:
            return {"status": "ok"}
        if not scheduler.healthy:
            error = scheduler.error
            detail = f"{type(error).__name__}: {error}" if error else "the engine thread is not running"
            return JSONResponse({"status": "unhealthy", "error": detail}, status_code=503)
        return JSONResponse({"status": "shutting_down"}, status_code=503)

    @app.get("/metrics", responses=schemas.METRICS_RESPONSES, response_class=Response)
    async def prometheus_metrics():
        return Response(metrics.exposition(), media_type=metrics.content_type)

    app.openapi = lambda: _openapi(app)
    return app


def _openapi(app: FastAPI) -> dict:
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


class _Service:
    """Submits prepared requests and turns their events into OpenAI responses."""

    def __init__(self, scheduler: Scheduler, builder: RequestBuilder, metrics: ServerMetrics, tokenizer,
                 model_name: str, config: ServerConfig):
        self.scheduler, self.builder, self.metrics = scheduler, builder, metrics
        self.tokenizer, self.model_name, self.config = tokenizer, model_name, config
        self.started = int(time.time())
        self.token_strings = TokenStrings(tokenizer)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _report(self, prepared: Prepared) -> LogprobReport | None:
        top_n = prepared.request.logprobs
        return None if top_n is None else LogprobReport(self.decode, self.token_strings, prepared.chat, top_n)

    async def serve(self, prepared: Prepared, request: Request):
        handles = self._submit(prepared)
        waiter = _Waiter(self.scheduler, handles, request, self.config.timeout_s)
        try:
            first = await waiter.next()
        except BaseException:
            waiter.close()
            raise
        if prepared.stream:
            waiter.watch_disconnect = False  # the streaming response is cancelled on disconnect instead
            return _EventStream(self._sse(prepared, waiter, first), on_exit=waiter.close)
        count = len(handles)
        tokens: list[list[int]] = [[] for _ in range(count)]
        logprobs: list[list] = [[] for _ in range(count)]
        last: list[BatchEvent | None] = [None] * count
        try:
            index, event = first
            while True:
                tokens[index] += event.tokens
                logprobs[index] += event.logprobs or []
                if event.finished:
                    last[index] = event
                    if all(last):
                        break
                index, event = await waiter.next()
        finally:
            waiter.close()
        build_choice = schemas.chat_choice if prepared.chat else schemas.completion_choice
        choices = []
        for index, event in enumerate(last):
            cut = self._cut(prepared, tokens[index], event)
            report = self._report(prepared)
            choices.append(build_choice(index, final_text(self.decode(tokens[index]), cut), event.finish_reason,
                                        report.whole(tokens[index], logprobs[index], cut) if report else None,
                                        self._stats(prepared, event) if count > 1 else None))
        usage = schemas.usage(len(prepared.request.prompt_ids), sum(map(len, tokens)), _prediction_counts(prepared, last))
        build = schemas.chat_response if prepared.chat else schemas.completion_response
        return build(prepared.request_id, self.model_name, choices, usage, self._stats(prepared, last[0]))

    def _submit(self, prepared: Prepared) -> list[Handle]:
        if len(prepared.requests) > self.config.max_batch + self.config.max_queue:
            raise ApiError(400, f"n is {len(prepared.requests)}; this server queues at most "
                                f"{self.config.max_batch + self.config.max_queue} requests (--max-batch + "
                                "--max-queue)", param="n")
        try:
            return self.scheduler.submit_all(list(prepared.requests), asyncio.get_running_loop())
        except QueueFull as err:
            self.metrics.on_rejected("queue_full")
            raise ApiError(429, f"the server is busy: {err}", type="rate_limit_exceeded", code="queue_full",
                           headers={"Retry-After": str(self.config.retry_after_s)}) from None
        except Unavailable as err:
            self.metrics.on_rejected("unavailable")
            raise ApiError(503, str(err), type="server_error", code="unavailable") from None

    def _cut(self, prepared: Prepared, tokens: list[int], event: BatchEvent) -> int | None:
        """Where a finished choice's text ends: before the stop string, or before the text of the stop
        token id it ended on (a character that token completes goes too)."""
        cut = event.stop_text_index
        if event.finish_reason == "stop" and tokens and tokens[-1] in prepared.stop_token_ids:
            before = len(self.decode(tokens[:-1]).rstrip(REPLACEMENT))
            cut = before if cut is None else min(cut, before)
        return cut

    async def _sse(self, prepared: Prepared, waiter: "_Waiter", first: tuple[int, BatchEvent]):
        request_id, model, chat = prepared.request_id, self.model_name, prepared.chat
        count = len(prepared.requests)
        texts = [StreamText(self.decode, prepared.request.stop.stop_strings) for _ in range(count)]
        # each chunk carries the logprobs of the tokens whose text it ends
        reports = [self._report(prepared) for _ in range(count)]

        def chunk(index: int, delta: str, finish_reason: str | None = None, stats: dict | None = None,
                  logprobs: dict | None = None) -> str:
            if chat:
                content = {"content": delta} if delta or logprobs or not finish_reason else {}
                body = schemas.chat_chunk(request_id, model, content, finish_reason, stats, logprobs, index)
            else:
                body = schemas.completion_chunk(request_id, model, delta, finish_reason, stats, logprobs, index)
            return _sse_data(body)

        tokens, left, finished = 0, count, []
        try:
            if chat:
                for index in range(count):
                    yield _sse_data(schemas.chat_chunk(request_id, model, {"role": "assistant", "content": ""},
                                                       index=index))
            index, event = first
            while True:
                tokens += len(event.tokens)
                text, report = texts[index], reports[index]
                if event.finished:
                    cut = self._cut(prepared, text.tokens + event.tokens, event)
                    delta = text.finish(event.tokens, cut)
                    logprobs = report.rest(event.tokens, event.logprobs, cut) if report else None
                    yield chunk(index, delta, event.finish_reason, self._stats(prepared, event), logprobs)
                    left -= 1
                    finished.append(event)
                    if not left:
                        if prepared.include_usage:
                            usage = schemas.usage(len(prepared.request.prompt_ids), tokens,
                                                  _prediction_counts(prepared, finished))
                            yield _sse_data(schemas.usage_chunk(request_id, model, chat, usage))
                        break
                else:
                    delta = text.add(event.tokens)
                    logprobs = report.through(event.tokens, event.logprobs, len(text.sent)) if report else None
                    if delta or logprobs:
                        yield chunk(index, delta, logprobs=logprobs)
                index, event = await waiter.next()
        except ApiError as err:  # headers are sent: report in the stream, as OpenAI and vLLM do
            yield _sse_data(err.body())
        finally:
            waiter.close()
        yield "data: [DONE]\n\n"

    @staticmethod
    def _stats(prepared: Prepared, event: BatchEvent) -> dict | None:
        if not prepared.return_spec_stats or event.stats is None:
            return None
        return event.stats.summary()


class _EventStream(StreamingResponse):
    """SSE response that runs ``on_exit`` however it ends: finished, client gone (Starlette cancels the
    response), or cancelled before the body generator even started (its ``finally`` would not run)."""

    def __init__(self, content, on_exit):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_exit = on_exit

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_exit()


class _Waiter:
    """Awaits the events of one request's choices (``next``: which choice, and its event); turns deadlines,
    engine failures and aborts into ApiErrors and aborts every unfinished choice in the engine when one
    fails or the consumer stops early (``close``)."""

    def __init__(self, scheduler: Scheduler, handles: list[Handle], request: Request, timeout_s: float):
        self.scheduler, self.handles, self.request, self.timeout_s = scheduler, handles, request, timeout_s
        self.deadline = asyncio.get_running_loop().time() + timeout_s
        self.watch_disconnect = True
        self.next_check = 0.0  # loop time of the next disconnect check
        self.done = [False] * len(handles)  # per choice: finished, failed or aborted

    async def next(self) -> tuple[int, BatchEvent]:
        loop = asyncio.get_running_loop()
        while True:
            now = loop.time()
            if now >= self.deadline:
                self._abort("timeout")
                raise ApiError(504, f"the request did not finish within {self.timeout_s:g} s (--timeout) and was "
                                    "aborted", type="timeout", code="timeout")
            if self.watch_disconnect and now >= self.next_check:
                self.next_check = now + DISCONNECT_POLL_S
                if await self.request.is_disconnected():
                    self._abort("abort")
                    raise ApiError(499, "the client disconnected", type="client_closed_request")
            found = await next_of(self.handles, min(self.deadline - now, DISCONNECT_POLL_S))
            if found is None:
                continue
            index, item = found
            if isinstance(item, EngineFailed):
                self.done[index] = True
                self._abort("abort")
                raise ApiError(500, str(item), type="server_error", code="engine_error")
            if item.finished:
                self.done[index] = True
                if item.finish_reason == "abort":
                    self._abort("shutdown")
                    raise ApiError(503, "the request was aborted because the server is shutting down",
                                   type="server_error", code="shutting_down")
            return index, item

    def close(self) -> None:
        """Abort the choices that have not finished (the consumer is gone); idempotent."""
        self._abort("abort")

    def _abort(self, reason: str) -> None:
        for index, handle in enumerate(self.handles):
            if not self.done[index]:
                self.done[index] = True
                self.scheduler.abort(handle.request_id, reason)


def _sse_data(body: dict) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


def _add_guard(app: FastAPI, config: ServerConfig) -> None:
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


def _add_error_handlers(app: FastAPI) -> None:
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


def _prediction_counts(prepared: Prepared, events: list) -> tuple[int, int] | None:
    """(accepted, rejected) predicted tokens over a request's choices: its drafts, verified and accepted or
    not (a request with a prediction drafts from it alone); None without a prediction."""
    if not prepared.request.prediction:
        return None
    stats = [event.stats for event in events if event is not None and event.stats is not None]
    accepted = sum(s.accepted for s in stats)
    return accepted, sum(s.drafted for s in stats) - accepted
