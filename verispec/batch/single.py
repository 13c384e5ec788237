"""One request at a time through ``BatchEngine``, with ``SpecEngine.generate``'s interface: what
``verispec generate`` runs for the native models (a batch of one decodes at SpecEngine's speed, with the
same tokens: experiments/batch_of_one.py).

    engine = BatchOfOne(SpecEngine(target, drafter, decode), spec)
    result = engine.generate(prompt_ids, sampling, spec, stop, seed=1)   # a GenerationResult
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
        if spec is not None and spec != self.spec:
            raise VerispecError("this engine was built for another SpecConfig; build one for this spec")
        tokens, last = [], None
        events = self.engine.add(BatchRequest("generate", list(prompt_ids), sampling, stop, seed=seed))
        while True:
            for event in events:
                tokens += event.tokens
                last = event
            if last is not None and last.finished:
                break
            events = self.engine.step()
        return GenerationResult(tokens, last.stats, last.finish_reason, last.stop_text_index)
