"""BatchEngine's interface over SpecEngine, one request at a time: how ``verispec serve`` runs the targets
whose caches do not batch (the compressed-attention model, transformers-backed models). The scheduler
admits one request, steps it round by round like a batch of one, and queues the rest; every drafting
method SpecEngine runs on that target is served, with the same tokens as ``verispec generate``.

    engine = SerialEngine(build_engine(pair, spec), spec, max_len=4096)
    events = engine.add(BatchRequest("a", prompt_ids, sampling, stop, seed=1))   # prefill: the first token
    while engine.active:
        events = engine.step()                                                    # one round's tokens

Log-probabilities and predicted outputs are BatchEngine's alone: such requests are refused up front
(``check``), with why.
"""

from __future__ import annotations

from verispec.batch.requests import BatchEvent, BatchRequest, check_request
from verispec.config import SpecConfig
from verispec.engine import Generation, SpecEngine
from verispec.errors import VerispecError


class SerialEngine:
    """One running request in ``engine`` (a SpecEngine built for ``spec``); ``max_len``: the tokens a request
    may hold (prompt + max_tokens), at most the target's context."""

    max_batch = 1

    def __init__(self, engine: SpecEngine, spec: SpecConfig, max_len: int):
        self.engine, self.spec = engine, spec
        self.target = engine.target
        self.max_len = min(max_len, engine.target.config.max_context)
        self._request: BatchRequest | None = None
        self._generation: Generation | None = None
        self._chunks = iter(())  # the running generation's rounds

    @property
    def active(self) -> int:
        return 0 if self._request is None else 1

    @property
    def has_capacity(self) -> bool:
        return self._request is None

    def check(self, request: BatchRequest) -> None:
        """Raise a user error if the request can never run here (before queueing it)."""
        check_request(request, self.target, self.max_len)
        what = "log-probabilities" if request.logprobs is not None else \
            "predicted outputs" if request.prediction else None
        if what is not None:
            raise VerispecError(f"{what} are served for the natively batched models (Llama, Qwen2, Mistral); "
                                "this target decodes one request at a time without them")

    def add(self, request: BatchRequest) -> list[BatchEvent]:
        """Start ``request`` (its prefill and first token)."""
        self.check(request)
        if not self.has_capacity:
            raise RuntimeError("a request is running; check has_capacity before add")
        self._request = request
        self._generation = self.engine.stream(list(request.prompt_ids), request.sampling, self.spec, request.stop,
                                              request.seed)
        self._chunks = iter(self._generation)
        return self._advance()

    def step(self) -> list[BatchEvent]:
        """One round of the running request: the tokens it committed (the last event is finished)."""
        return [] if self._request is None else self._advance()

    def abort(self, request_id: str) -> BatchEvent | None:
        if self._request is None or self._request.request_id != request_id:
            return None
        stats = self._generation.stats
        stats.finish_reason = "abort"
        self._request = self._generation = None
        return BatchEvent(request_id, [], "abort", stats=stats)

    def _advance(self) -> list[BatchEvent]:
        request, generation = self._request, self._generation
        try:
            tokens = next(self._chunks)
        except StopIteration:
            tokens = []
        except BaseException:
            self._request = self._generation = None  # the scheduler fails the request; the engine stays usable
            raise
        if generation.finish_reason is None:
            return [BatchEvent(request.request_id, tokens)]
        for _ in self._chunks:  # nothing is left to decode: this ends the loop and writes the result
            pass
        self._request = self._generation = None
        result = generation.result
        return [BatchEvent(request.request_id, tokens, result.finish_reason, result.stop_text_index, result.stats)]
