"""Serving one OpenAI request (``Service``): submit its choices to the scheduler, await their events
(``_Waiter``: deadline, client disconnect, engine failure, shutdown) and build the JSON response or the
SSE stream of chunks. Used by the routes of ``verispec.server.app``."""

from __future__ import annotations

import asyncio
import json
import time

from fastapi import Request
from fastapi.responses import StreamingResponse

from verispec.batch import BatchEvent
from verispec.server import schemas
from verispec.server.logprobs import LogprobReport, TokenStrings
from verispec.server.metrics import ServerMetrics
from verispec.server.prepare import Prepared, RequestBuilder
from verispec.server.scheduler import EngineFailed, Handle, QueueFull, Scheduler, ServerConfig, Unavailable, next_of
from verispec.server.schemas import ApiError
from verispec.server.text import REPLACEMENT, StreamText, final_text

DISCONNECT_POLL_S = 0.25  # how often a waiting non-streamed request checks that its client is still there


class Service:
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
        usage = schemas.usage(len(prepared.request.prompt_ids), sum(map(len, tokens)),
                              _prediction_counts(prepared, last))
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


def _prediction_counts(prepared: Prepared, events: list) -> tuple[int, int] | None:
    """(accepted, rejected) predicted tokens over a request's choices: its drafts, verified and accepted or
    not (a request with a prediction drafts from it alone); None without a prediction."""
    if not prepared.request.prediction:
        return None
    stats = [event.stats for event in events if event is not None and event.stats is not None]
    accepted = sum(s.accepted for s in stats)
    return accepted, sum(s.drafted for s in stats) - accepted
