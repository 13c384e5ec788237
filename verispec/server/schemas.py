"""OpenAI request bodies, error bodies and response/chunk builders.

Request models check types only; value ranges are checked once, by ``SamplingParams`` / ``StopRules`` /
``BatchEngine.check``, and come back as HTTP 400 in OpenAI's error format:

    {"error": {"message": "top_p must be in (0, 1] (1 = off), got 0.0", "type": "invalid_request_error",
               "param": "top_p", "code": null}}

Extensions beyond OpenAI's fields: ``top_k``, ``min_p``, ``ignore_eos``, ``stop_token_ids`` (as in vLLM)
and ``return_spec_stats`` (adds the request's ``RequestStats.summary()`` as ``spec_stats``).

``n`` (1..``MAX_CHOICES``) choices come back as ``choices`` with ``index`` 0..n-1; a chunk of a stream
carries one choice, by its index. With ``return_spec_stats`` and n > 1, each choice of a whole response
also carries its own ``spec_stats`` (the top-level one is choice 0's), and each choice's final chunk its own.

Logprobs (``logprobs: N`` for completions, ``logprobs: true`` + ``top_logprobs: N`` for chat, N in
0..20) are formatted by ``verispec.server.logprobs`` and passed to the builders here as ``logprobs``.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, StrictInt

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
DEFAULT_CHAT_MAX_TOKENS = 128  # chat: at most this many, or what is left of the context
MAX_TOP_LOGPROBS = 20  # OpenAI's limit on logprobs (completions) and top_logprobs (chat)
MAX_CHOICES = 16  # the most choices (``n``) one request may ask for


class ApiError(Exception):
    """An error response: ``status`` plus OpenAI's error body."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error body, for every status the server answers with an error."""

    error: ErrorDetail


def _error(description: str) -> dict:
    return {"model": ErrorResponse, "description": description}


# The statuses each kind of route can answer besides 200, as documented in the OpenAPI schema.
AUTH_RESPONSES = {401: _error("the API key is missing or wrong (--api-key)")}
REQUEST_RESPONSES = {
    200: {"description": "the completion: a JSON object, or with stream: true server-sent events",
          "content": {"application/json": {}, "text/event-stream": {}}},
    400: _error("the request is invalid: malformed JSON, a wrong type or value, an unsupported field"),
    **AUTH_RESPONSES,
    413: _error("the body is larger than --max-body-bytes"),
    429: {**_error("the queue is full; retry after the Retry-After header's seconds"),
          "headers": {"Retry-After": {"description": "seconds to wait", "schema": {"type": "integer"}}}},
    500: _error("the engine failed while decoding this request"),
    503: _error("the server is shutting down or its engine stopped"),
    504: _error("the request ran past --timeout"),
}
METRICS_RESPONSES = {200: {"description": "Prometheus text exposition",
                           "content": {"text/plain": {"schema": {"type": "string"}}}}, **AUTH_RESPONSES}
HEALTH_RESPONSES = {503: {"description": "shutting down, or the engine is not running",
                          "content": {"application/json": {"schema": {
                              "type": "object", "required": ["status"],
                              "properties": {"status": {"type": "string"}, "error": {"type": "string"}}}}}}}


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[StrictInt] | None = None  # vLLM's extension: stop when one of these ids is generated
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    ignore_eos: bool = False
    return_spec_stats: bool = False
    # Structured outputs: OpenAI's response_format (json_object, json_schema), or this server's
    # structured_outputs (exactly one of "json": a schema, "regex": a pattern, "grammar": Lark text).
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    # Predicted output (OpenAI): its tokens are the drafts of this request, verified as any others.
    prediction: dict[str, Any] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM's extension: > 0, 1 = off
    # Accepted for compatibility; anything but their neutral value is refused (see ``unsupported``).
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    def unsupported(self) -> list[str]:
        """Fields set to something this server does not do."""
        return ["logit_bias"] if self.logit_bias else []


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int]
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def unsupported(self) -> list[str]:
        extra = [name for name in ("echo", "suffix") if getattr(self, name)]
        return super().unsupported() + extra + (["best_of"] if self.best_of not in (None, 1) else [])


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None

    def unsupported(self) -> list[str]:
        return super().unsupported() + (["tools"] if self.tools else [])


# ---- responses ------------------------------------------------------------------------------------------


def usage(prompt_tokens: int, completion_tokens: int, prediction: tuple[int, int] | None = None) -> dict:
    """OpenAI's usage; ``prediction``: (accepted, rejected) predicted tokens, for a request with one."""
    body = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
    if prediction is not None:
        body["completion_tokens_details"] = {"accepted_prediction_tokens": prediction[0],
                                             "rejected_prediction_tokens": prediction[1]}
    return body


def completion_choice(index: int, text: str, finish_reason: str, logprobs: dict | None = None,
                      spec_stats: dict | None = None) -> dict:
    return _with_stats({"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason},
                       spec_stats)


def chat_choice(index: int, text: str, finish_reason: str, logprobs: dict | None = None,
                spec_stats: dict | None = None) -> dict:
    return _with_stats({"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                        "finish_reason": finish_reason}, spec_stats)


def completion_response(request_id: str, model: str, choices: list[dict], usage_: dict,
                        spec_stats: dict | None) -> dict:
    body = {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": usage_}
    return _with_stats(body, spec_stats)


def chat_response(request_id: str, model: str, choices: list[dict], usage_: dict, spec_stats: dict | None) -> dict:
    body = {"id": request_id, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": usage_}
    return _with_stats(body, spec_stats)


def completion_chunk(request_id: str, model: str, text: str, finish_reason: str | None = None,
                     spec_stats: dict | None = None, logprobs: dict | None = None, index: int = 0) -> dict:
    body = {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}]}
    return _with_stats(body, spec_stats)


def chat_chunk(request_id: str, model: str, delta: dict, finish_reason: str | None = None,
               spec_stats: dict | None = None, logprobs: dict | None = None, index: int = 0) -> dict:
    body = {"id": request_id, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]}
    return _with_stats(body, spec_stats)


def usage_chunk(request_id: str, model: str, chat: bool, usage_: dict) -> dict:
    """The last chunk when ``stream_options.include_usage``: no choices, only usage."""
    return {"id": request_id, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": [], "usage": usage_}


def _with_stats(body: dict, spec_stats: dict | None) -> dict:
    if spec_stats is not None:
        body["spec_stats"] = spec_stats
    return body
