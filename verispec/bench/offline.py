"""Offline runs at fixed concurrency, every variant on the same prompts, interleaved.

Concurrency 1 runs each request alone (``SpecEngine``: chains, trees, self-speculation; or the peer's
``generate``). Concurrency c > 1 runs ``BatchEngine`` with continuous batching: at most c requests in
flight, the next joins as soon as one leaves; every native variant takes part (peers run alone).

Interleaving: the prompt list is cut into slices of c * slice_waves prompts (one prompt at c = 1) and
every variant runs a slice before any variant runs the next one, in an order rotated per slice and
repeat, so that machine noise (other processes, thermal drift) hits all variants alike.

    result = run_offline(runners, prompts, jobs_for, settings, memory, progress)
    result.records, result.walls[("chain", "c1", 0)]
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field, replace

from verispec.batch import BatchEngine, BatchRequest
from verispec.bench.checks import check
from verispec.bench.config import OfflineSettings, Variant
from verispec.bench.environment import PeakMemory
from verispec.bench.records import RequestRecord, record_from_stats
from verispec.bench.workloads import BenchPrompt
from verispec.config import SamplingParams, StopRules
from verispec.errors import VerispecError
from verispec.loading import ModelPair, build_single, row_drafter

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Job:
    """One request as every variant will see it."""

    prompt: BenchPrompt
    stop: StopRules
    seed: int
    repeat: int
    load: str

    def new_record(self, variant: str) -> RequestRecord:
        p = self.prompt
        return RequestRecord(variant=variant, load=self.load, repeat=self.repeat, prompt_id=p.prompt_id, task=p.task,
                             prompt_tokens=len(p.prompt_ids), max_tokens=self.stop.max_tokens)


@dataclass
class OfflineResult:
    records: list[RequestRecord] = field(default_factory=list)
    walls: dict = field(default_factory=dict)  # (variant, load, repeat) -> seconds
    cpu: dict = field(default_factory=dict)  # (variant, load, repeat) -> this process's CPU seconds
    notes: list[str] = field(default_factory=list)


def run_offline(runners: dict, prompts: list[BenchPrompt], make_job, settings: OfflineSettings,
                memory: PeakMemory, progress=None) -> OfflineResult:
    """``runners``: variant name -> runner (``run(jobs, concurrency) -> records``); ``make_job(prompt,
    index, repeat, load) -> Job``."""
    result = OfflineResult()
    names = list(runners)
    _warm_up(runners, prompts, make_job, settings)
    for concurrency in settings.concurrency:
        active = [n for n in names if concurrency == 1 or runners[n].variant.batchable]
        skipped = [n for n in names if n not in active]
        if skipped:
            result.notes.append(f"concurrency {concurrency}: {', '.join(skipped)} run one request at a time only "
                                "(the transformers peer is not batched)")
        load, size = f"c{concurrency}", 1 if concurrency == 1 else concurrency * settings.slice_waves
        indexed = list(enumerate(prompts))
        slices = [indexed[i:i + size] for i in range(0, len(indexed), size)]
        for repeat in range(settings.repeats):
            for k, chunk in enumerate(slices):
                jobs = [make_job(prompt, index, repeat, load) for index, prompt in chunk]
                shift = (k + repeat) % len(active)
                for name in active[shift:] + active[:shift]:
                    memory.reset()
                    began, cpu_began = time.perf_counter(), time.process_time()
                    records = runners[name].run(jobs, concurrency)
                    wall, cpu = time.perf_counter() - began, time.process_time() - cpu_began
                    peak = memory.peak_mb()
                    for record in records:
                        record.peak_memory_mb = peak
                    result.records += records
                    key = (name, load, repeat)
                    result.walls[key] = result.walls.get(key, 0.0) + wall
                    result.cpu[key] = result.cpu.get(key, 0.0) + cpu
                    if progress is not None:
                        progress.update(len(jobs))
    return result


def _warm_up(runners: dict, prompts: list[BenchPrompt], make_job, settings: OfflineSettings) -> None:
    """First calls pay one-off allocation costs; keep them out of the records."""
    for _ in range(settings.warmup):
        for runner in runners.values():
            for concurrency in settings.concurrency:
                if concurrency > 1 and not runner.variant.batchable:
                    continue
                jobs = [make_job(p, i, -1, "warmup") for i, p in enumerate(prompts[:concurrency])]
                runner.run([replace(j, stop=replace(j.stop, max_tokens=min(j.stop.max_tokens, 8))) for j in jobs],
                           concurrency)


def finish_record(record: RequestRecord, job: Job, tokens: list[int], finish_reason: str,
                  stop_text_index: int | None, decode) -> RequestRecord:
    """Decode the output (cut before a stop string) and run the task's check."""
    text = decode(tokens)
    if stop_text_index is not None:
        text = text[:stop_text_index]
    record.tokens, record.text, record.finish_reason = list(tokens), text, finish_reason
    record.status = "ok"
    checked = check(job.prompt.task, job.prompt.text, text, job.prompt.reference)
    record.correct, record.valid = checked.get("correct"), checked.get("valid")
    return record


def fail_record(record: RequestRecord, status: str, message: str, elapsed_s: float) -> RequestRecord:
    record.status, record.finish_reason, record.error, record.e2e_s = status, status, message, elapsed_s
    return record


class NativeRunner:
    """Our engine: one request at a time through ``build_single`` (the batched engine as a batch of one),
    ``BatchEngine`` (continuous batching) at c > 1."""

    def __init__(self, pair: ModelPair, variant: Variant, sampling: SamplingParams, timeout_s: float, decode,
                 longest: int = 0):
        """``longest``: the longest prompt + max_tokens of the run, so batched caches are sized once."""
        self.pair, self.variant, self.sampling, self.timeout_s, self.decode = pair, variant, sampling, timeout_s, decode
        self.longest = longest
        self.engine = build_single(pair, variant.spec)
        self.batch_engines: dict[int, BatchEngine] = {}

    def run(self, jobs: list[Job], concurrency: int) -> list[RequestRecord]:
        if concurrency == 1:
            return [self._run_one(job) for job in jobs]
        return self._run_batched(jobs, concurrency)

    def _run_one(self, job: Job) -> RequestRecord:
        record = job.new_record(self.variant.name)
        began = time.perf_counter()
        try:
            generation = self.engine.stream(list(job.prompt.prompt_ids), self.sampling, self.variant.spec, job.stop,
                                            job.seed)
            for _ in generation:
                if time.perf_counter() - began > self.timeout_s:
                    return fail_record(record, "timeout", f"no finish within {self.timeout_s:g} s",
                                       time.perf_counter() - began)
        except Exception as err:  # any failure is a failed request: recorded, never dropped
            _log_failure(err)
            return fail_record(record, "error", f"{type(err).__name__}: {err}", time.perf_counter() - began)
        result = generation.result
        record_from_stats(record, result.stats)
        return finish_record(record, job, result.tokens, result.finish_reason, result.stop_text_index, self.decode)

    def _batch_engine(self, concurrency: int, jobs: list[Job]) -> BatchEngine:
        longest = max([self.longest] + [len(j.prompt.prompt_ids) + j.stop.max_tokens for j in jobs])
        longest += self.variant.num_drafts + 1
        engine = self.batch_engines.get(concurrency)
        if engine is None or engine.max_len < longest:
            max_len = min(self.pair.target.config.max_context, longest)
            engine = BatchEngine(self.pair.target, self.pair.draft, self.variant.spec, max_batch=concurrency,
                                 max_len=max_len, decode=self.decode, eagle=self.pair.eagle,
                                 make_drafter=row_drafter(self.pair, self.variant.spec))
            self.batch_engines[concurrency] = engine
        return engine

    def _run_batched(self, jobs: list[Job], concurrency: int) -> list[RequestRecord]:
        engine = self._batch_engine(concurrency, jobs)
        by_id = {f"{j.prompt.prompt_id}/{j.repeat}": j for j in jobs}
        records = {rid: job.new_record(self.variant.name) for rid, job in by_id.items()}
        tokens: dict[str, list[int]] = {rid: [] for rid in by_id}
        started: dict[str, float] = {}
        pending = deque(by_id)
        done: set[str] = set()

        def handle(events) -> None:
            for event in events:
                tokens[event.request_id] += event.tokens
                if event.finished and event.stats is not None:
                    rid = event.request_id
                    record_from_stats(records[rid], event.stats)
                    finish_record(records[rid], by_id[rid], tokens[rid], event.finish_reason,
                                  event.stop_text_index, self.decode)
                    done.add(rid)

        while pending or engine.active:
            while pending and engine.has_capacity:
                rid = pending.popleft()
                job = by_id[rid]
                started[rid] = time.perf_counter()
                try:
                    handle(engine.add(BatchRequest(rid, list(job.prompt.prompt_ids), self.sampling, job.stop,
                                                   job.seed)))
                except Exception as err:
                    _log_failure(err)
                    fail_record(records[rid], "error", f"{type(err).__name__}: {err}", 0.0)
                    done.add(rid)
            try:
                handle(engine.step())
            except Exception as err:  # the batch state is unknown now: fail its requests, start afresh
                _log_failure(err)
                now = time.perf_counter()
                for rid in [r for r in started if r not in done]:
                    fail_record(records[rid], "error", f"{type(err).__name__}: {err}", now - started[rid])
                    done.add(rid)
                self.batch_engines.pop(concurrency, None)
                engine = self._batch_engine(concurrency, jobs)
                continue
            now = time.perf_counter()
            for rid in [r for r in started if r not in done and now - started[r] > self.timeout_s]:
                engine.abort(rid)
                fail_record(records[rid], "timeout", f"no finish within {self.timeout_s:g} s", now - started[rid])
                done.add(rid)
        return list(records.values())


def _log_failure(err: Exception) -> None:
    if isinstance(err, VerispecError):
        log.warning("request failed: %s", err)
    else:
        log.warning("request failed", exc_info=err)
