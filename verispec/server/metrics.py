"""Prometheus metrics for ``/metrics``, named like vLLM's (``vllm:`` -> ``verispec:``).

Speculative decoding counters, summed over every finished request's rounds (``RequestStats``):

- ``verispec:spec_decode_num_drafts``: rounds that verified at least one draft token
  (rounds with gamma 0, e.g. when the adaptive policy switches speculation off, do not count);
- ``verispec:spec_decode_num_draft_tokens``: proposed draft tokens;
- ``verispec:spec_decode_num_accepted_tokens``: accepted draft tokens (not the recovered/bonus token);
- ``verispec:spec_decode_num_accepted_tokens_per_pos{position="i"}``: rounds whose draft at 0-based
  position i was accepted.

So acceptance rate = accepted_tokens / draft_tokens and mean acceptance length (committed tokens per
round) = 1 + accepted_tokens / num_drafts, as in vLLM. Latency histograms are measured by the server
from the request's arrival, so they include time spent waiting in the queue: end-to-end, time to first
token, and inter-token latency (a round that emits n tokens contributes one real gap and n - 1 zeros,
see stats.py). Counted when the request finishes; tokens and TTFT as they happen.
"""

from __future__ import annotations

import time

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from verispec.batch import BatchEvent

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.0, 0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5, 5.0, 10.0)


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()  # one per app: several servers may live in one process
        labels, reg = {"model_name": model_name}, self.registry

        def counter(name, doc, extra=()):
            return Counter(f"verispec:{name}", doc, ["model_name", *extra], registry=reg)

        def histogram(name, doc, buckets):
            return Histogram(f"verispec:{name}", doc, ["model_name"], buckets=buckets, registry=reg).labels(**labels)

        self.labels = labels
        self.num_drafts = counter("spec_decode_num_drafts", "Verification rounds with at least one draft token.")
        self.num_draft_tokens = counter("spec_decode_num_draft_tokens", "Proposed draft tokens.")
        self.num_accepted_tokens = counter("spec_decode_num_accepted_tokens", "Accepted draft tokens.")
        self.accepted_per_pos = counter("spec_decode_num_accepted_tokens_per_pos",
                                        "Accepted draft tokens at each 0-based draft position.", ["position"])
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to last token, seconds.", LATENCY_BUCKETS)
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first token, seconds.", LATENCY_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds",
                             "Gap before each output token; tokens after the first of a round count 0.", ITL_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Arrival to admission into the batch, seconds.",
                                    LATENCY_BUCKETS)
        self.finished = counter("request_success", "Finished requests by reason (stop, length, abort, timeout, "
                                                   "shutdown).", ["finished_reason"])
        self.failed = counter("request_failure", "Requests that got an error status, by reason.", ["reason"])
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of admitted requests.")
        self.generation_tokens = counter("generation_tokens", "Generated (committed) tokens.")
        self.running = Gauge("verispec:num_requests_running", "Requests in the batch.", ["model_name"],
                             registry=reg).labels(**labels)
        self.waiting = Gauge("verispec:num_requests_waiting", "Requests waiting for a batch row.", ["model_name"],
                             registry=reg).labels(**labels)
        for counter_ in (self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens, self.prompt_tokens,
                         self.generation_tokens):
            counter_.labels(**labels)  # export zeros from the start
        for reason in ("stop", "length", "abort"):
            self.finished.labels(finished_reason=reason, **labels)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    # ---- hooks called by the scheduler (engine thread) or the app ---------------------------------------

    def set_queue(self, running: int, waiting: int) -> None:
        self.running.set(running)
        self.waiting.set(waiting)

    def on_admit(self, handle) -> None:
        self.queue_time.observe(handle.admitted - handle.arrived)
        self.prompt_tokens.labels(**self.labels).inc(len(handle.request.prompt_ids))

    def on_tokens(self, handle, count: int, now: float) -> None:
        if handle.last_emit is None:
            self.ttft.observe(now - handle.arrived)
        else:
            self.itl.observe(now - handle.last_emit)
        for _ in range(count - 1):
            self.itl.observe(0.0)
        self.generation_tokens.labels(**self.labels).inc(count)

    def on_finish(self, handle, event: BatchEvent, reason: str) -> None:
        self.e2e.observe(time.perf_counter() - handle.arrived)
        self.finished.labels(finished_reason=reason, **self.labels).inc()
        if event.stats is None:
            return
        rounds = event.stats.rounds
        self.num_drafts.labels(**self.labels).inc(sum(1 for r in rounds if r.drafted > 0))
        self.num_draft_tokens.labels(**self.labels).inc(sum(r.drafted for r in rounds))
        self.num_accepted_tokens.labels(**self.labels).inc(sum(r.accepted for r in rounds))
        per_position: dict[int, int] = {}
        for r in rounds:
            for position in range(r.accepted):
                per_position[position] = per_position.get(position, 0) + 1
        for position, count in per_position.items():
            self.accepted_per_pos.labels(position=str(position), **self.labels).inc(count)

    def on_failure(self, handle, reason: str) -> None:
        self.failed.labels(reason=reason, **self.labels).inc()

    def on_rejected(self, reason: str) -> None:
        self.failed.labels(reason=reason, **self.labels).inc()
