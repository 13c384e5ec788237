"""What goes into and comes out of the batched engine: requests, events, committed tokens' logprobs, and
the engine's per-row state."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from verispec.adaptive import AcceptanceCounts
from verispec.config import SamplingParams, StopRules
from verispec.drafters.base import Drafter
from verispec.drafters.prediction import PredictionDrafter
from verispec.errors import ContextError, VerispecError
from verispec.stats import RequestStats


@dataclass
class BatchRequest:
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: StopRules = field(default_factory=StopRules)
    seed: int = 0
    logprobs: int | None = None  # None: none; N >= 0: each token's log-probability and the N most likely
    prediction: list[int] | None = None  # predicted output tokens: this row's drafts (verispec.drafters.prediction)


@dataclass(frozen=True)
class TokenLogprob:
    """A committed token's log-probability (raw or processed: BatchEngine's logprobs_mode), and the most likely
    tokens at its position (best first)."""
    logprob: float
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


LOGPROBS_MODES = ("raw", "processed")
MIN_LOGPROB = -9999.0  # a token the processed distribution excludes (probability 0), as vLLM reports it


def token_logprobs(logits: torch.Tensor, tokens: list[int], top_n: int,
                   probs: torch.Tensor | None = None) -> list[TokenLogprob]:
    """``logits`` (T, V): the target's raw logits whose row i scored ``tokens[i]``; in float32. With
    ``probs`` (T, V), the distributions the tokens were sampled from (penalties, grammar mask,
    temperature, top-k/p, min-p applied; one-hot when greedy): their logs instead, MIN_LOGPROB for 0."""
    if probs is None:
        logprobs = torch.log_softmax(logits[:len(tokens)].float(), dim=-1)  # (T, V)
    else:
        logprobs = torch.log(probs[:len(tokens)].float()).clamp_min(MIN_LOGPROB)
    chosen = logprobs[torch.arange(len(tokens)), torch.tensor(tokens, dtype=torch.long)].tolist()
    if top_n == 0:
        return [TokenLogprob(value) for value in chosen]
    top = torch.topk(logprobs, min(top_n, logprobs.shape[-1]), dim=-1)  # sorted, best first
    return [TokenLogprob(value, tuple(ids), tuple(values))
            for value, ids, values in zip(chosen, top.indices.tolist(), top.values.tolist())]


@dataclass
class BatchEvent:
    request_id: str
    tokens: list[int]  # committed this round (may be empty)
    finish_reason: str | None = None  # "stop" | "length" | "abort" once finished
    stop_text_index: int | None = None
    stats: RequestStats | None = None  # set when finished
    logprobs: list[TokenLogprob] | None = None  # one per token, when the request asked for them

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class Row:
    """One running request: its committed context, its own generator, and what drafts for it."""
    request: BatchRequest
    context: list[int]
    generator: torch.Generator
    stats: RequestStats
    started: float
    last_emit: float
    generated: list[int] = field(default_factory=list)
    draft_seen: list[int] = field(default_factory=list)  # tokens the shared batched draft has read for it
    acceptance: AcceptanceCounts = field(default_factory=AcceptanceCounts)
    drafter: Drafter | None = None  # this row's own drafter (trees, self, EAGLE trees, n-gram), or None
    features: list = field(default_factory=list)  # target features the shared EAGLE head has not paired yet
    paired: int = 0  # pairs the shared EAGLE head holds for it
    prediction: PredictionDrafter | None = None  # drafts from the request's predicted output instead

    @property
    def remaining(self) -> int:
        return self.request.stop.max_tokens - len(self.generated)


def check_request(request: BatchRequest, target, max_len: int) -> None:
    """Raise a user error if ``request`` can never run on ``target`` with ``max_len`` tokens a request (prompt +
    max_tokens) at most."""
    if not request.prompt_ids:
        raise VerispecError("the prompt is empty; give at least one token")
    vocab = target.config.vocab_size
    if any(not 0 <= token < vocab for token in request.prompt_ids):
        raise VerispecError(f"prompt token ids must be in [0, {vocab}); got an id outside it")
    if len(request.prompt_ids) + request.stop.max_tokens > max_len:
        what = "the model's context" if max_len == target.config.max_context else "the context"
        raise ContextError(f"prompt ({len(request.prompt_ids)} tokens) + max_tokens ({request.stop.max_tokens}) "
                           f"exceeds {what} of {max_len} tokens; shorten the prompt or lower max_tokens")
