"""OpenAI request bodies -> ``BatchRequest`` for the engine, or an ``ApiError`` (HTTP 400) saying why not.

    builder = RequestBuilder(pair.tokenizer, pair.target, "verispec-default", engine.check, engine.max_len)
    prepared = builder.completion(CompletionRequest(prompt="Hello", max_tokens=8, temperature=0))
    prepared.request.prompt_ids, prepared.request.stop.max_tokens      # [..], 8

EOS: the tokenizer's and the target config's ids (``loading.eos_ids``); chat requests also stop at the
chat template's end-of-message token ``<|end|>`` when the tokenizer has one.

Choices: ``n`` (1..``MAX_CHOICES``) makes one ``BatchRequest`` per choice (ids ``<id>-0`` .. ``<id>-<n-1>``
when n > 1), so the engine batches them like separate requests. Choice i samples with seed ``seed + i``
when the request gives a seed, else with its own random seed; each has its own grammar constraint.

Stop token ids (vLLM's ``stop_token_ids``): generating one ends the choice with ``finish_reason: stop``,
as EOS does, and its text is not part of the output (vLLM's default). They join the request's EOS ids in
``StopRules``; under ``ignore_eos`` they are the only ones there (with ``ignore_eos`` off), so they still
stop while the model's EOS does not.

Structured outputs: ``response_format`` ``{"type": "json_object"}`` or ``{"type": "json_schema",
"json_schema": {"schema": {...}}}``, or ``structured_outputs`` with exactly one of ``json`` (a schema),
``regex`` or ``grammar`` (Lark). Each request gets its own matcher (``verispec.grammar``), compiled
against the tokenizer on the first such request (about half a second for a 49k vocabulary).
"""

from __future__ import annotations

import random
import uuid
from dataclasses import dataclass, replace
from typing import Callable

from verispec.batch import BatchRequest
from verispec.loading import eos_ids
from verispec.config import SamplingParams, StopRules
from verispec.errors import ContextError, VerispecError
from verispec.grammar import GrammarCompiler, GrammarError, GrammarSpec
from verispec.server.schemas import (DEFAULT_CHAT_MAX_TOKENS, DEFAULT_COMPLETION_MAX_TOKENS, MAX_CHOICES,
                                     MAX_TOP_LOGPROBS, ApiError, ChatCompletionRequest, CompletionRequest, _Common)

END_OF_MESSAGE = "<|end|>"
SEED_RANGE = (-2**63, 2**64)  # what torch.Generator.manual_seed accepts
STRUCTURED_KEYS = ("json", "regex", "grammar")
GREEDY_BELOW = 1e-5  # a positive temperature below this is greedy (vLLM's rule)


@dataclass(frozen=True)
class Prepared:
    requests: tuple[BatchRequest, ...]  # one per choice, in choice order
    request_id: str  # the response's id
    chat: bool
    stream: bool
    include_usage: bool
    return_spec_stats: bool
    stop_token_ids: frozenset[int] = frozenset()  # ending on one of these cuts its text from the output

    @property
    def request(self) -> BatchRequest:
        """The first choice's request (every choice has the same prompt and stop rules)."""
        return self.requests[0]


class RequestBuilder:
    def __init__(self, tokenizer, target, model_name: str, check: Callable[[BatchRequest], None], max_len: int):
        self.tokenizer, self.model_name, self.check = tokenizer, model_name, check
        self.vocab_size, self.max_len = target.config.vocab_size, max_len
        eos = tuple(eos_ids(tokenizer, target))
        end = tokenizer.get_vocab().get(END_OF_MESSAGE)
        self.eos, self.chat_eos = eos, eos + ((end,) if end is not None and end not in eos else ())
        self._compilers: dict[tuple[int, ...], GrammarCompiler] = {}  # per EOS set, built on first use

    def completion(self, body: CompletionRequest) -> Prepared:
        self._common_checks(body)
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise ApiError(400, f"prompt lists hold exactly one prompt here (got {len(prompt)}); send one "
                                    "request per prompt", param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            prompt_ids = self._encode(prompt)
        else:
            prompt_ids = list(prompt)
            bad = [t for t in prompt_ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ApiError(400, f"prompt token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})",
                               param="prompt")
        max_tokens = DEFAULT_COMPLETION_MAX_TOKENS if body.max_tokens is None else body.max_tokens
        return self._build(body, "cmpl", prompt_ids, max_tokens, self.eos, "prompt", chat=False)

    def chat(self, body: ChatCompletionRequest) -> Prepared:
        self._common_checks(body)
        if not body.messages:
            raise ApiError(400, "messages is empty; give at least one message", param="messages")
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                    for m in body.messages]
        try:
            encoded = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                         return_dict=False)
        except Exception as err:  # no template, or the template refused these messages (jinja raises)
            raise ApiError(400, f"cannot apply the model's chat template: {err}", param="messages") from None
        prompt_ids = list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        if max_tokens is None:  # as much as fits, up to a default
            max_tokens = max(1, min(DEFAULT_CHAT_MAX_TOKENS, self.max_len - len(prompt_ids)))
        return self._build(body, "chatcmpl", prompt_ids, max_tokens, self.chat_eos, "messages", chat=True)

    def _encode(self, text: str, param: str = "prompt") -> list[int]:
        try:
            return list(self.tokenizer.encode(text, add_special_tokens=False))
        except Exception as err:  # e.g. a lone surrogate that JSON escapes allow
            raise ApiError(400, f"the {param} cannot be tokenized: {err}", param=param) from None

    def _common_checks(self, body: _Common) -> None:
        if body.model is not None and body.model != self.model_name:
            raise ApiError(400, f"the model {body.model!r} does not exist; this server serves "
                                f"{self.model_name!r} (see /v1/models)", param="model", code="model_not_found")
        if not 1 <= body.n <= MAX_CHOICES:
            raise ApiError(400, f"n must be in 1..{MAX_CHOICES} (choices per request), got {body.n}", param="n")
        unsupported = body.unsupported()
        if unsupported:
            raise ApiError(400, f"{unsupported[0]} is not supported by this server; leave it unset",
                           param=unsupported[0])
        if body.seed is not None and not SEED_RANGE[0] <= body.seed < SEED_RANGE[1]:
            raise ApiError(400, f"seed must be in [-2**63, 2**64), got {body.seed}", param="seed")
        if body.seed is not None and body.seed + body.n - 1 >= SEED_RANGE[1]:
            raise ApiError(400, f"choice i samples with seed + i: seed + n - 1 must be below 2**64, got seed "
                                f"{body.seed} with n {body.n}", param="seed")

    def _build(self, body: _Common, prefix: str, prompt_ids: list[int], max_tokens: int, eos: tuple[int, ...],
               prompt_param: str, chat: bool) -> Prepared:
        sampling = _sampling(body)
        grammar = _grammar(body)
        if grammar is not None:  # the first choice's; compiling it checks the grammar before anything runs
            sampling = replace(sampling, guide=self._constraint(grammar, eos))
        stop_strings = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
        if any(not s for s in stop_strings):
            raise ApiError(400, "stop strings must not be empty", param="stop")
        stop_ids = self._stop_token_ids(body)
        if body.ignore_eos and stop_ids:  # the model's EOS is ignored, the requested ids still stop
            stop_eos, ignore_eos = stop_ids, False
        else:
            stop_eos, ignore_eos = eos + tuple(t for t in stop_ids if t not in eos), body.ignore_eos
        try:
            stop = StopRules(max_tokens=max_tokens, eos_ids=stop_eos, ignore_eos=ignore_eos,
                             stop_strings=stop_strings)
        except VerispecError as err:
            raise ApiError(400, str(err), param="max_tokens") from None
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        seeds = [random.randrange(2**63) if body.seed is None else body.seed + i for i in range(body.n)]
        first = BatchRequest(request_id if body.n == 1 else f"{request_id}-0", prompt_ids, sampling, stop,
                             seed=seeds[0], logprobs=_logprobs(body), prediction=self._prediction(body))
        try:
            self.check(first)  # the choices differ only in their seed and their grammar's state
        except ContextError as err:
            raise ApiError(400, f"{err}; shorten the prompt or lower max_tokens", param="max_tokens",
                           code="context_length_exceeded") from None
        except VerispecError as err:
            raise ApiError(400, str(err), param=prompt_param) from None
        requests = [first]
        for i in range(1, body.n):  # a constraint is per-request state: never shared between choices
            guide = None if grammar is None else self._constraint(grammar, eos)
            requests.append(replace(first, request_id=f"{request_id}-{i}", seed=seeds[i],
                                    sampling=replace(sampling, guide=guide)))
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return Prepared(tuple(requests), request_id, chat, body.stream, include_usage, body.return_spec_stats,
                        frozenset(stop_ids))

    def _prediction(self, body: _Common) -> list[int] | None:
        """OpenAI's predicted output, ``{"type": "content", "content": text or text parts}``, as token ids."""
        prediction = body.prediction
        if prediction is None:
            return None
        content = prediction.get("content") if isinstance(prediction, dict) else None
        if isinstance(content, list) and all(isinstance(p, dict) and isinstance(p.get("text"), str) for p in content):
            content = "".join(part["text"] for part in content)
        if not isinstance(prediction, dict) or prediction.get("type") != "content" or not isinstance(content, str):
            raise ApiError(400, 'prediction must be {"type": "content", "content": text or a list of text parts}',
                           param="prediction")
        return self._encode(content, "prediction") or None

    def _stop_token_ids(self, body: _Common) -> tuple[int, ...]:
        ids = tuple(dict.fromkeys(body.stop_token_ids or ()))
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ApiError(400, f"stop_token_ids: {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})",
                           param="stop_token_ids")
        return ids

    def _constraint(self, grammar: tuple[str, GrammarSpec], eos: tuple[int, ...]):
        param, spec = grammar
        try:
            if eos not in self._compilers:
                self._compilers[eos] = GrammarCompiler(self.tokenizer, self.vocab_size, eos)
            return self._compilers[eos].constraint(spec)
        except VerispecError as err:
            raise ApiError(400, str(err), param=param) from None


def _grammar(body: _Common) -> tuple[str, GrammarSpec] | None:
    """The request's grammar and the field that set it, or None for free text."""
    form, structured = body.response_format, body.structured_outputs
    kind = (form or {}).get("type", "text")
    if kind != "text" and structured:
        raise ApiError(400, "set either response_format or structured_outputs, not both", param="structured_outputs")
    try:
        if kind == "json_object":
            return "response_format", GrammarSpec("json_object")
        if kind == "json_schema":
            schema = (form.get("json_schema") or {}).get("schema") if isinstance(form.get("json_schema"), dict) else None
            if schema is None:
                raise ApiError(400, "response_format json_schema needs json_schema.schema (a JSON schema object)",
                               param="response_format")
            return "response_format", GrammarSpec.json_schema(schema)
        if kind != "text":
            raise ApiError(400, f"response_format type must be text, json_object or json_schema; got {kind!r}",
                           param="response_format")
        if not structured:
            return None
        if len(structured) != 1 or next(iter(structured)) not in STRUCTURED_KEYS:
            raise ApiError(400, "structured_outputs takes exactly one of " + ", ".join(STRUCTURED_KEYS),
                           param="structured_outputs")
        (key, value), = structured.items()
        if key == "json":
            return "structured_outputs", GrammarSpec.json_schema(value)
        if not isinstance(value, str):
            raise ApiError(400, f"structured_outputs.{key} must be a string", param="structured_outputs")
        return "structured_outputs", GrammarSpec("regex" if key == "regex" else "lark", value)
    except GrammarError as err:
        raise ApiError(400, str(err), param="response_format" if kind != "text" else "structured_outputs") from None


def _logprobs(body: _Common) -> int | None:
    """How many alternatives per token the request wants with its tokens' logprobs; None: no logprobs.
    Completions say ``logprobs: N``; chat says ``logprobs: true`` and ``top_logprobs: N`` (default 0)."""
    if isinstance(body, CompletionRequest):
        count, param = body.logprobs, "logprobs"
    else:
        if body.top_logprobs is not None and not body.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        count, param = (body.top_logprobs or 0) if body.logprobs else None, "top_logprobs"
    if count is not None and not 0 <= count <= MAX_TOP_LOGPROBS:
        raise ApiError(400, f"{param} must be in 0..{MAX_TOP_LOGPROBS}, got {count}", param=param)
    return count


def _sampling(body: _Common) -> SamplingParams:
    given = {name: getattr(body, name) for name in ("temperature", "top_k", "top_p", "min_p", "presence_penalty",
                                                    "frequency_penalty", "repetition_penalty")
             if getattr(body, name) is not None}
    if 0 < given.get("temperature", 1.0) < GREEDY_BELOW:  # as vLLM: logits / 1e-300 would overflow to inf
        given["temperature"] = 0.0
    try:
        return SamplingParams(**given)
    except VerispecError as err:
        message = str(err)
        param = next((name for name in given if message.startswith(name)), None)
        raise ApiError(400, message, param=param) from None

