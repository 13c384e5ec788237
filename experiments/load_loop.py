"""What the closed-loop scripts share (policy_windows.py, process_spread.py): requests for a prompt set
and a closed loop that keeps ``concurrency`` of them running on a BatchEngine, a finished one replaced at
once. Imported by those scripts, which run from this folder, so it is on their import path."""

import time

from verispec.batch import BatchRequest
from verispec.config import SamplingParams, StopRules


def greedy_requests(prompts) -> list[BatchRequest]:
    """One greedy request per prompt of a bench prompt set, its max_tokens generated (EOS ignored)."""
    return [BatchRequest(p.prompt_id, list(p.prompt_ids), SamplingParams(temperature=0),
                         StopRules(max_tokens=p.max_tokens, ignore_eos=True)) for p in prompts]


def closed_loop(engine, requests: list[BatchRequest], concurrency: int) -> float:
    """Run every request, at most ``concurrency`` at once; output tokens/s over the wall time."""
    queue = list(requests)
    tokens, began = 0, time.perf_counter()
    while queue or engine.active:
        while queue and engine.active < concurrency:
            tokens += sum(len(e.tokens) for e in engine.add(queue.pop(0)))
        tokens += sum(len(e.tokens) for e in engine.step())
    return tokens / (time.perf_counter() - began)
