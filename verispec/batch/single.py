"""One request at a time through ``BatchEngine``, with ``SpecEngine.generate``'s interface: what
``verispec generate`` runs for the native models (a batch of one decodes at SpecEngine's speed, with the
same tokens: experiments/batch_of_one.py).

    engine = BatchOfOne(SpecEngine(target, drafter, decode), spec)
    result = engine.generate(prompt_ids, sampling, spec, stop, seed=1)   # a GenerationResult
    generation = engine.stream(prompt_ids, sampling, spec, stop, seed=1)
    for chunk in generation: ...                                         # token ids as rounds commit them
    generation.result                                                    # the GenerationResult, once exhausted
"""

from __future__ import annotations

from verispec.batch.engine import BatchEngine
from verispec.batch.requests import BatchRequest
from verispec.config import SamplingParams, SpecConfig, StopRules
from verispec.engine import GenerationResult, SpecEngine
from verispec.errors import VerispecError


class BatchOfOne:
    """``single``'s target, drafter (lent to the one row), decoder and gamma policy, run by a
    ``BatchEngine`` of one row built for ``spec``."""

    def __init__(self, single: SpecEngine, spec: SpecConfig):
        drafter = single.drafter
        self.spec, self.decode = spec, single.decode
        self.engine = BatchEngine(single.target, None, spec, max_batch=1, decode=single.decode,
                                  gamma_policy=single.gamma_policy if spec.method == "chain" else None,
                                  make_drafter=(lambda: drafter) if spec.enabled else None)

    def generate(self, prompt_ids: list[int], sampling: SamplingParams = SamplingParams(),
                 spec: SpecConfig | None = None, stop: StopRules = StopRules(), seed: int = 0) -> GenerationResult:
        generation = self.stream(prompt_ids, sampling, spec, stop, seed)
        for _ in generation:
            pass
        return generation.result

    def stream(self, prompt_ids: list[int], sampling: SamplingParams = SamplingParams(),
               spec: SpecConfig | None = None, stop: StopRules = StopRules(), seed: int = 0) -> "OneGeneration":
        """An iterator over emitted chunks (lists of token ids); ``.result`` once exhausted, as
        ``SpecEngine.stream`` gives them."""
        if spec is not None and spec != self.spec:
            raise VerispecError("this engine was built for another SpecConfig; build one for this spec")
        if self.engine.active:  # an earlier generation left unfinished (abandoned, or it raised): drop its row
            self.engine.abort("generate")
        return OneGeneration(self.engine, BatchRequest("generate", list(prompt_ids), sampling, stop, seed=seed))


class OneGeneration:
    """The one request's rounds: the prefill runs at the first ``next``; a finished request's stats,
    finish reason and stop-string index become ``result``."""

    def __init__(self, engine: BatchEngine, request: BatchRequest):
        self.engine, self.request = engine, request
        self.result: GenerationResult | None = None
        self._tokens: list[int] = []
        self._started = False

    def __iter__(self) -> "OneGeneration":
        return self

    def __next__(self) -> list[int]:
        while self.result is None:
            events = self.engine.step() if self._started else self.engine.add(self.request)
            self._started = True
            chunk = []
            for event in events:
                chunk += event.tokens
                if event.finished:
                    self.result = GenerationResult(self._tokens + chunk, event.stats, event.finish_reason,
                                                   event.stop_text_index)
            self._tokens += chunk
            if chunk:
                return chunk
        raise StopIteration
