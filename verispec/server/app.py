"""The FastAPI app: OpenAI routes, health, metrics, and the lifespan that runs the scheduler (serving a
request: ``service.py``; the API-key guard and error bodies: ``middleware.py``).

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
import signal
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from verispec import profile as profiler
from verispec.adaptive import AdaptiveGamma, FixedGamma
from verispec.batch import BatchEngine
from verispec.config import SpecConfig
from verispec.errors import VerispecError
from verispec.loading import DEFAULT_TARGET, ModelPair, check_backend_supports, row_drafter
from verispec.policy_trace import PolicyTrace
from verispec.server import schemas
from verispec.server.metrics import ServerMetrics
from verispec.server.middleware import add_error_handlers, add_guard, openapi_without_422
from verispec.server.prepare import RequestBuilder
from verispec.server.scheduler import Scheduler, ServerConfig
from verispec.server.schemas import ChatCompletionRequest, CompletionRequest
from verispec.server.service import DISCONNECT_POLL_S, Service  # noqa: F401  (DISCONNECT_POLL_S re-exported)



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
                     draft_weights: str = "auto", draft_vocab: str | int | None = "auto",
                     eagle: str | None = None) -> tuple[ModelPair, SpecConfig]:
    """The pair a server runs and the spec it runs it with, as ``serve`` and each Ray replica load them: a
    draft model only for the draft-model method (its draft vocabulary resolved), the EAGLE head for
    ``eagle`` (a draft with another tokenizer is lent to each row, drafting through a vocabulary bridge)."""
    from verispec.loading import check_model_args, load_pair, resolve_draft_vocab

    needs_draft = spec.enabled and spec.drafter == "model"
    check_model_args(target, draft, needs_draft)
    pair = load_pair(target, draft, device=device, need_draft=needs_draft, backend=backend,
                     draft_weights=draft_weights, need_eagle=spec.enabled and spec.drafter == "eagle",
                     eagle_dir=eagle)
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
                       make_drafter=make_drafter or row_drafter(pair, spec))


def create_app(pair: ModelPair, spec: SpecConfig = SpecConfig(), config: ServerConfig = ServerConfig(),
               adaptive: bool = False, model_name: str | None = None, profile: dict | None = None,
               trace_rounds: str | None = None, make_drafter=None) -> FastAPI:
    model_name = model_name or default_model_name(pair)
    engine = build_batch_engine(pair, spec, config, adaptive, profile, trace_rounds, make_drafter)
    metrics = ServerMetrics(model_name)
    scheduler = Scheduler(engine, config, metrics)
    builder = RequestBuilder(pair.tokenizer, pair.target, model_name, scheduler.check, engine.max_len)
    service = Service(scheduler, builder, metrics, pair.tokenizer, model_name, config)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        scheduler.start()
        yield
        await asyncio.to_thread(scheduler.shutdown)  # a worker thread: handlers still finishing need the loop

    app = FastAPI(title="verispec", summary="OpenAI-compatible server with lossless speculative decoding",
                  lifespan=lifespan)
    app.state.scheduler, app.state.metrics, app.state.model_name = scheduler, metrics, model_name
    add_error_handlers(app)
    add_guard(app, config)

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

    app.openapi = lambda: openapi_without_422(app)
    return app
